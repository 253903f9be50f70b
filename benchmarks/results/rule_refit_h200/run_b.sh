#!/usr/bin/env bash
# The decode GEMM's variants on the other shapes, then the GPU tests.
set -uo pipefail
o=/tmp/rb; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD ESCHA_GIT_SHA=${TREE_LABEL:-unknown}
t0=$SECONDS
timeout 170 python benchmarks/bench_decode_wgmma.py --out $o/var_other --rounds 3 --ms 64,128,256 --shapes down,qkv_8b,down_8b --variants > $o/var.txt 2>&1
echo "variants rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/steps.log $OUT/
t0=$SECONDS
timeout 400 python -m pytest -q -m gpu tests > $o/gpu_tests.txt 2>&1
echo "gpu_tests rc=$? s=$((SECONDS-t0))" >> $o/steps.log
cp $o/steps.log $OUT/; tail -3 $o/gpu_tests.txt > $OUT/gpu_tail.txt
tar -czf $OUT/rb.tgz -C /tmp rb
