#!/usr/bin/env bash
# Branch decode-next (the loop's counters and one words box a step; the halves codec and the
# overlapped loop as variants) against main: bench_decode_wgmma on both trees, then the GPU tests
# of the touched files. The trees (NEW_DIR, default the working directory; BASE_DIR, default
# main checked out under _ab/base). The new tree's "wgmma" arm
# is the exact codec with the counters; its --variants add, in the same process, the halves codec
# at 8-32 tokens ("halves", "halves_w3", "halves_f1w5") and the overlapped loop at 64 and 128
# tokens ("overlap_w3", "overlap").
set -uo pipefail
new=${NEW_DIR:-$PWD}; base=${BASE_DIR:-$PWD/_ab/base}; o=/tmp/lo; mkdir -p $o
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd $dir && PYTHONPATH=$dir timeout $limit "$@" ) > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; mkdir -p $OUT/lo; cp -r $o/. $OUT/lo/; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "new: ${NEW_SHA:-decode-next}; base: ${BASE_SHA:-main}; date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
# The timings first, so a slow test run cannot cost them.
step bench_new $new 260 env ESCHA_GIT_SHA=${NEW_SHA:-decode-next} python benchmarks/bench_decode_wgmma.py --out $o/new \
  --ms 1,8,16,32,64,128 --shapes gate_up,down,down_8b --rounds 3 --variants
step bench_base $base 150 env ESCHA_GIT_SHA=${BASE_SHA:-main} python benchmarks/bench_decode_wgmma.py --out $o/base \
  --ms 1,8,16,32,64,128 --shapes gate_up,down,down_8b --rounds 3
step tests $new 170 python -m pytest -q -x -m gpu tests/test_decode_wgmma.py tests/test_launch.py tests/test_transforms.py
