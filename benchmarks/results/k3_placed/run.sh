#!/usr/bin/env bash
# Prepared for one H200 call, not run yet: the K=3 codec's states placed in the top half of a word
# and shifted down (candidate.patch; README.md), and its mul.hi form as two more arms. The device
# copy is patched in place; the arm before is the commit the patch applies to (.prev/, from
# `benchmarks/snapshot_kernels.sh REV REV`, carried).
# Usage on the device: ESCHA_GIT_SHA=<REV>+k3placed REV=<REV> bash benchmarks/results/k3_placed/run.sh
set -u
export PYTHONPATH=$PWD
O=$OUT/k3; mkdir -p $O
git apply benchmarks/results/k3_placed/candidate.patch 2>/dev/null || patch -p1 < benchmarks/results/k3_placed/candidate.patch \
    || { echo "patch does not apply"; exit 1; }
# The bit-exact gates first: the fp16 fragments and the fp8 tiles against the reference codec
# (K = 2 and 3), then both GEMMs within their tolerance tables.
timeout 150 python -m pytest -q -m gpu tests/test_decode_wgmma.py tests/test_decode_fp8.py -p no:cacheprovider \
    > $O/gpu_tests.txt 2>&1
tail -n 2 $O/gpu_tests.txt
bash benchmarks/results/k3_placed/make_mulhi.sh || exit 1  # the other form, as arms wgmma@mulhi, fp8@mulhi
timeout 170 python benchmarks/bench_decode_wgmma.py --out $O/wgmma_k3 --bits 3 --ms 1,8,16,32,64 \
    --shapes gate_up,down,down_8b --rounds 3 --previous .prev/decode_wgmma_$REV.py,.prev/decode_wgmma_mulhi.py > $O/wgmma_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/wgmma_k3/decode_wgmma.log | cut -c1-260
timeout 120 python benchmarks/bench_decode_fp8.py --out $O/fp8_k3 --bits 3 --ms 96,128,256 --shapes gate_up,down \
    --rounds 3 --previous .prev/decode_fp8_$REV.py,.prev/decode_fp8_mulhi.py > $O/fp8_k3.txt 2>&1
grep -E "^(gate_up|down|GATE)" $O/fp8_k3/decode_fp8.log | cut -c1-260
ESCHA_SANITIZER_PATHS=decode-wgmma,decode-fp8 ESCHA_SANITIZER_MS=1,16,100 ESCHA_SANITIZER_GRID=small timeout 120 \
    benchmarks/run_sanitizer.sh $O/sanitizer.txt > /dev/null 2>&1
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer.txt | tail -n 6
cd $OUT && tar czf k3.tgz k3
