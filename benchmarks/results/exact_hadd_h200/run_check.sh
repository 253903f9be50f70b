#!/usr/bin/env bash
# One H200 call at a244c05: the register-operand decode at 40 and 48 tokens on the seed shapes
# (issue #12's 40-token point; the 64-token build), then the gpu-marked tests of the files whose
# paths take the decode GEMMs (as far as the call's time allows).
set -u
export PYTHONPATH=$PWD
O=$OUT/check; mkdir -p $O
timeout 70 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_40 --ms 40,48 --shapes gate_up,down --rounds 3 \
    > $O/wgmma_40.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma_40/decode_wgmma.log | cut -c1-200
timeout 200 python -m pytest -q -m gpu -p no:cacheprovider tests/test_dispatch.py tests/test_norms.py tests/test_matmul.py \
    tests/test_determinism.py tests/test_fuzz.py tests/test_nn.py > $O/gpu_tests.txt 2>&1
tail -3 $O/gpu_tests.txt
cd $OUT && tar czf check.tgz check && rm -rf check
