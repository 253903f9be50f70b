#!/usr/bin/env bash
# One H200 call: the exact codec's halves added by two scalar add.f16 (HADD2 with swizzled operands,
# one PRMT to pack) instead of two PRMT and one add.f16x2 (this tree, branch exact-hadd), against
# 11b05e7 (.prev/, made by ../shift_state_h200/make_prev.sh 11b05e7, carried): fragment and product
# GPU tests, bench_decode_wgmma at 16-64 tokens with the variants at their measured capacity (the
# halves codec and one fragment at 16-32 tokens, after the shift made the halves codec cheaper), and
# bench_decode_fp8 at 96-256.
set -u
export PYTHONPATH=$PWD
O=$OUT/hadd; mkdir -p $O
timeout 100 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    -k "bit_exact or (within_tolerance and not variants)" > $O/gpu_tests.txt 2>&1
tail -2 $O/gpu_tests.txt
timeout 300 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 16,32,64 --shapes gate_up,down,down_8b \
    --rounds 3 --variants --previous .prev/decode_wgmma_11b05e7.py > $O/wgmma.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-400
timeout 130 python benchmarks/bench_decode_fp8.py --out $O/fp8 --ms 96,128,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_11b05e7.py > $O/fp8.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8/decode_fp8.log | cut -c1-220
