#!/usr/bin/env bash
# One H200 call, two independent candidates on one tree (each touches a path the other's arms do
# not run): ../fp8_x16/candidate.patch (the fp8 decode GEMM, 65-256 tokens: weights as 16 T straight
# from the codec) and ../xpad_h200/candidate.patch (the register-operand GEMM, <= 64 tokens: x' with
# the GEMM's rounded rows). Arms: the patched tree against commit REV's kernels (.prev/*_REV.py with
# their own transforms, from `benchmarks/snapshot_kernels.sh REV REV`, carried), one process a path.
# Usage on the device: ESCHA_GIT_SHA=<sha>+x16+xpad REV=<REV> bash benchmarks/results/x16_xpad_h200/run.sh
set -u
export PYTHONPATH=$PWD
O=$OUT/ab; mkdir -p $O
for c in fp8_x16 xpad_h200; do
  { git apply benchmarks/results/$c/candidate.patch || patch -p1 < benchmarks/results/$c/candidate.patch; } \
    || { echo "$c does not apply"; exit 1; }
done
# Gates: both GEMMs' decoded operands bit for bit against the reference codec (e4m3(16 T) for the
# fp8 one), their partials and whole calls within their tolerance tables, also with an outlier row.
timeout 150 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    -k "bit_exact or within_tolerance or partials_are or outlier" > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
timeout 170 python benchmarks/bench_decode_fp8.py --out $O/fp8_k2 --ms 96,128,192,256 --shapes gate_up,down,down_8b \
    --rounds 3 --previous .prev/decode_fp8_$REV.py > $O/fp8_k2.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k2/decode_fp8.log | cut -c1-240
timeout 120 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 24,40,48,56 --shapes gate_up,down,down_8b \
    --rounds 3 --breakdown --previous .prev/decode_wgmma_$REV.py > $O/wgmma.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-240
timeout 80 python benchmarks/bench_decode_fp8.py --out $O/fp8_k3 --bits 3 --ms 128,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_$REV.py > $O/fp8_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k3/decode_fp8.log | cut -c1-240
cd $OUT && tar czf ab.tgz ab
