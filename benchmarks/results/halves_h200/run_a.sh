#!/usr/bin/env bash
# The halves codec as the rule's at K=2 and 8 tokens: the decode GEMM at 1-16 tokens with the
# variants (the exact codec's two fragments, the rule before, in the same process), the GPU tests,
# then compute-sanitizer memcheck and racecheck on the reduced grid (1 and 7 tokens: halves).
set -uo pipefail
o=$OUT/a; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout $limit "$@" > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
step decode 100 python benchmarks/bench_decode_wgmma.py --out $o/decode --ms 1,8,16 \
  --shapes gate_up,down,down_8b --rounds 3 --variants
step gpu_tests 280 python -m pytest -q -m gpu tests
step sanitizer 230 env ESCHA_SANITIZER_GRID=small benchmarks/run_sanitizer.sh $o/sanitizer_small_h200.txt
