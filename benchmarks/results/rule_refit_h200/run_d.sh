#!/usr/bin/env bash
# ncu of the decode GEMM's loop at gate_up M=8 and 64, then compute-sanitizer on the reduced grid.
set -uo pipefail
o=/tmp/rd; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD ESCHA_GIT_SHA=${TREE_LABEL:-unknown}
for m in 8 64; do
  t0=$SECONDS
  timeout 110 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 --launch-count 1 --set full \
    python benchmarks/profile_decode.py --shape gate_up --m $m --calls 8 > $o/ncu_gemm_gate_up_m$m.txt 2>&1
  echo "ncu_m$m rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/steps.log $OUT/
done
t0=$SECONDS
ESCHA_SANITIZER_GRID=small timeout 260 benchmarks/run_sanitizer.sh $o/sanitizer_small_h200.txt
echo "sanitizer rc=$? s=$((SECONDS-t0))" >> $o/steps.log
cp $o/steps.log $OUT/
tar -czf $OUT/rd.tgz -C /tmp rd
