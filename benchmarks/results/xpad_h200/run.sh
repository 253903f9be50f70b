#!/usr/bin/env bash
# Prepared for one H200 call, not run yet: x' with the GEMM's rounded rows. At 40 tokens the
# register-operand GEMM, on the 48-token call's build and 48-row partials, took 40.0 us alone on
# gate_up against 34.9 at 48 (../partial_rows_h200/): what still differs is x', 40 rows, so TMA
# zero-fills 24 rows of each 64-row box. candidate.patch allocates x' with partial_rows(M) rows
# (the input transform writes the tokens' rows only; the rows past them feed partial rows the
# output transform never reads). The device copy is patched in place; the arm before is the
# commit the patch applies to (.prev/, from `benchmarks/snapshot_kernels.sh REV REV`, carried).
# Usage on the device: ESCHA_GIT_SHA=<REV>+xpad REV=<REV> bash benchmarks/results/xpad_h200/run.sh
set -u
export PYTHONPATH=$PWD
O=$OUT/xpad; mkdir -p $O
git apply benchmarks/results/xpad_h200/candidate.patch 2>/dev/null || patch -p1 < benchmarks/results/xpad_h200/candidate.patch \
    || { echo "patch does not apply"; exit 1; }
timeout 100 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_matmul.py -p no:cacheprovider \
    -k "bit_exact or within_tolerance or wgmma" > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
timeout 120 python benchmarks/bench_decode_wgmma.py --out $O/wgmma --ms 24,40,48,56 --shapes gate_up,down,down_8b \
    --rounds 3 --breakdown --previous .prev/decode_wgmma_$REV.py > $O/wgmma.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma/decode_wgmma.log | cut -c1-330
ESCHA_SANITIZER_PATHS=decode-wgmma ESCHA_SANITIZER_MS=9,40 ESCHA_SANITIZER_GRID=small timeout 90 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer.txt | tail -n 6
cd $OUT && tar czf xpad.tgz xpad
