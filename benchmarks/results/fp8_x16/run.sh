#!/usr/bin/env bash
# One H200 call: the fp8 decode GEMM's weights as 16 T straight from the codec (candidate.patch,
# on c25f908; README.md). The device copy is patched in place. Arms: the rule of commit REV
# (.prev/*_REV.py, from `benchmarks/snapshot_kernels.sh REV REV`, carried) and the patched tree.
# Usage on the device: ESCHA_GIT_SHA=<REV>+x16 REV=<REV> bash benchmarks/results/fp8_x16/run.sh
set -u
export PYTHONPATH=$PWD
O=$OUT/x16; mkdir -p $O
{ git apply benchmarks/results/fp8_x16/candidate.patch || patch -p1 < benchmarks/results/fp8_x16/candidate.patch; } || { echo "x16 patch does not apply"; exit 1; }
# Gates: the e4m3 tiles bit for bit against e4m3(16 T) of the reference codec, the partials against
# their own e4m3 product, whole calls within the fp8 table, through the op, the dispatcher and the norms.
timeout 200 python -m pytest -q -m gpu tests/test_decode_fp8.py tests/test_dispatch.py tests/test_norms.py \
    -p no:cacheprovider > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
timeout 200 python benchmarks/bench_decode_fp8.py --out $O/fp8_k2 --ms 96,128,192,256 --rounds 3 \
    --previous .prev/decode_fp8_$REV.py > $O/fp8_k2.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k2/decode_fp8.log | cut -c1-260
timeout 100 python benchmarks/bench_decode_fp8.py --out $O/fp8_k3 --bits 3 --ms 128,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_$REV.py > $O/fp8_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k3/decode_fp8.log | cut -c1-260
ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 ESCHA_SANITIZER_GRID=small timeout 85 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer.txt | tail -n 6
cd $OUT && tar czf x16.tgz x16
