#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on the reduced grid, then the model end to end.
set -uo pipefail
o=/tmp/r3; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
t0=$SECONDS
ESCHA_GIT_SHA=${TREE_LABEL} ESCHA_SANITIZER_GRID=small timeout 250 benchmarks/run_sanitizer.sh $o/sanitizer_small_h200.txt
echo "sanitizer rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/sanitizer_small_h200.txt $o/steps.log $OUT/
t0=$SECONDS
ESCHA_GIT_SHA=${TREE_LABEL} timeout ${E2E_LIMIT:-120} python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --batches 1,8 --new-tokens 64 --repeats 2 --out $o/e2e_h200.json > $o/e2e.txt 2>&1
echo "e2e rc=$? s=$((SECONDS-t0))" >> $o/steps.log
tar -czf $OUT/r3.tgz -C /tmp r3
