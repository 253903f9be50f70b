#!/usr/bin/env bash
# GPU tests, then the decode GEMM's variants on gate_up.
set -uo pipefail
o=/tmp/ra; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD ESCHA_GIT_SHA=${TREE_LABEL:-unknown}
t0=$SECONDS
timeout 250 python -m pytest -q -m gpu tests > $o/gpu_tests.txt 2>&1
echo "gpu_tests rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/steps.log $OUT/; tail -3 $o/gpu_tests.txt > $OUT/gpu_tail.txt
t0=$SECONDS
timeout ${BENCH_LIMIT:-300} python benchmarks/bench_decode_wgmma.py --out $o/var_gate_up --rounds 3 --ms ${MS:-1,8,16,32,64,128,256} --shapes ${SHAPES:-gate_up} --variants > $o/var.txt 2>&1
echo "variants rc=$? s=$((SECONDS-t0))" >> $o/steps.log
cp $o/steps.log $OUT/
tar -czf $OUT/ra.tgz -C /tmp ra
