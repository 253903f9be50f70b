#!/usr/bin/env bash
# The even split's final rule: every GPU test, then the decode call on four shapes, each kernel
# alone beside the whole call; then the input transform's A/B (a branch's script) if present.
set -uo pipefail
root=$PWD; o=/tmp/r2; mkdir -p $o
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd $dir && PYTHONPATH=$dir timeout $limit "$@" ) > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "tree: ${TREE_LABEL:-working tree}; date $(date -u +%FT%TZ)"; } > $o/env.txt 2>&1
step gpu_tests $root 280 python -m pytest -q -m gpu tests
step bench $root 220 env ESCHA_GIT_SHA=${TREE_LABEL:-even-split} python benchmarks/bench_decode_wgmma.py --out $o/bench --ms 1,8,16,40,64,128,256 --shapes gate_up,down,qkv_8b,down_8b --rounds 3 --breakdown
tar -czf $OUT/r2.tgz -C /tmp r2
