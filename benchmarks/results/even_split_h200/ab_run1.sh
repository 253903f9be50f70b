#!/usr/bin/env bash
# Even split vs main: GPU tests of the touched files, then bench_decode_wgmma on both trees.
set -uo pipefail
root=$PWD; o=/tmp/r1; mkdir -p $o
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd $dir && PYTHONPATH=$dir timeout $limit "$@" ) > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "new: even-split working tree on eb165e9; base: eb165e9; date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
step tests $root 200 python -m pytest -q -x -m gpu tests/test_decode_wgmma.py tests/test_transforms.py tests/test_decode.py
step bench_new $root 230 env ESCHA_GIT_SHA=even-split python benchmarks/bench_decode_wgmma.py --out $o/new --ms 1,8,16,64,128 --shapes gate_up,down,down_8b --rounds 3 --variants --breakdown
step bench_base $root/_ab/base 150 env ESCHA_GIT_SHA=eb165e9 python benchmarks/bench_decode_wgmma.py --out $o/base --ms 1,8,16,64,128 --shapes gate_up,down,down_8b --rounds 3
tar -czf $OUT/r1.tgz -C /tmp r1
