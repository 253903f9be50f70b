#!/usr/bin/env bash
# The command of the H200 call that wrote this folder, as it ran (2026-12-05, the call after ../ab/'s,
# which began 03:03 UTC; NVIDIA H200, torch 2.11.0+cu130, triton 3.6.0, the device's copy of
# 6c3b853 with ../../fp8_x16/candidate.patch and ../../xpad_h200/candidate.patch applied; the
# sanitizer reports' "git: c25f908" is what the device copy's git metadata said, not this tree;
# their date, 03:09 UTC, is this call's): every gpu-marked test, then memcheck and racecheck of both
# decode paths on the reduced grid.
export PYTHONPATH=$PWD
for c in fp8_x16 xpad_h200; do
  git apply benchmarks/results/$c/candidate.patch || patch -p1 < benchmarks/results/$c/candidate.patch || exit 1
done
O=$OUT/suite; mkdir -p $O
ESCHA_GIT_SHA=6c3b853+x16+xpad timeout 400 python -m pytest -q -m gpu -p no:cacheprovider tests > $O/gpu_suite.txt 2>&1
echo suite rc=$?; tail -n 3 $O/gpu_suite.txt
for tool in memcheck racecheck; do
  ESCHA_SANITIZER_PATHS=decode-wgmma,decode-fp8 ESCHA_SANITIZER_MS=1,40,100,130,300 ESCHA_SANITIZER_GRID=small \
    ESCHA_SANITIZER_TOOLS=$tool timeout 80 benchmarks/run_sanitizer.sh $O/sanitizer_$tool.txt > /dev/null 2>&1
  echo $tool rc=$?
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|cases|FAIL" $O/sanitizer_$tool.txt | sort | uniq -c | tail -n 5
done
