#!/usr/bin/env bash
# The loop's counters and one words box a step (branch loop-overhead) against main: GPU tests of
# the touched files, then bench_decode_wgmma on both trees (main checked out under _ab/base).
set -uo pipefail
root=$PWD; o=/tmp/lo; mkdir -p $o
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd $dir && PYTHONPATH=$dir timeout $limit "$@" ) > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; cp $o/steps.log $OUT/; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "new: ${NEW_SHA:-loop-overhead}; base: ${BASE_SHA:-main}; date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
step tests $root 240 python -m pytest -q -x -m gpu tests/test_decode_wgmma.py tests/test_launch.py tests/test_dispatch.py
step bench_new $root 150 env ESCHA_GIT_SHA=${NEW_SHA:-loop-overhead} python benchmarks/bench_decode_wgmma.py --out $o/new \
  --ms 1,8,16,32,64,128 --shapes gate_up,down,down_8b --rounds 3
step bench_base $root/_ab/base 150 env ESCHA_GIT_SHA=${BASE_SHA:-main} python benchmarks/bench_decode_wgmma.py --out $o/base \
  --ms 1,8,16,32,64,128 --shapes gate_up,down,down_8b --rounds 3
tar -czf $OUT/lo.tgz -C /tmp lo
