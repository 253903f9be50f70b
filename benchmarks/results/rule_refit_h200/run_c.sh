#!/usr/bin/env bash
# The dense sweep of every escha path beside cuBLAS on the seed's shapes, then fit_dispatch.
set -uo pipefail
o=/tmp/rc; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD ESCHA_GIT_SHA=${TREE_LABEL:-unknown}
ARMS=escha,escha-decode,escha-decode-wgmma,escha-prefill,escha-dequant-core-fp8,escha-dequant-fp8,torch-bf16,torch-fp8
MS=1,2,4,8,16,24,32,48,64,96,128,192,256,384,512,768,1024,2048,4096,8192
res=()
for shape in gate_up down; do
  t0=$SECONDS
  timeout 250 python -m escha.cli bench --arms "$ARMS" --m "$MS" --shapes "$shape" --out "$o/sweep_$shape" > $o/sweep_$shape.txt 2>&1
  echo "sweep_$shape rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/steps.log $OUT/
  f="$o/sweep_$shape/results.json"; [ -f "$f" ] || f="$o/sweep_$shape/results.partial.json"; res+=("$f")
done
timeout 40 python benchmarks/fit_dispatch.py "${res[@]}" --out "$o/fit_dispatch.md" --json "$o/fit_dispatch.json" > $o/fit.txt 2>&1
echo "fit rc=$?" >> $o/steps.log
cp $o/steps.log $OUT/
tar -czf $OUT/rc.tgz -C /tmp rc
