#!/usr/bin/env bash
# The loop's counters on main: the GPU tests, then compute-sanitizer memcheck and racecheck on the
# reduced grid (both tools; 1, 7, 40 and 130 tokens cover every variant the rule takes).
set -uo pipefail
o=$OUT/a; mkdir -p $o
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout $limit "$@" > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
step gpu_tests 290 python -m pytest -q -m gpu tests
step sanitizer 260 env ESCHA_SANITIZER_GRID=small benchmarks/run_sanitizer.sh $o/sanitizer_small_h200.txt
