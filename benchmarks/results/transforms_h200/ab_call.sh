#!/usr/bin/env bash
# A/B of the decode call's kernels and host time: the working tree ("new", repository root)
# against _ab/base (7ec43bf), then the touched tests on the GPU with the time left.
set -uo pipefail
root=$PWD; o=/tmp/c2; mkdir -p $o
export PYTHONUNBUFFERED=1
start=$SECONDS
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd $dir && PYTHONPATH=$dir timeout $limit "$@" ) > $o/$name.txt 2>&1
  echo "$name rc=$? s=$((SECONDS-t0))" >> $o/steps.log; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $o/env.txt 2>&1
echo "new: working tree on 7ec43bf; base: 7ec43bf; date $(date -u +%FT%TZ)" >> $o/env.txt
step bd_new $root 140 env ESCHA_GIT_SHA=c2cb05d python benchmarks/bench_decode_wgmma.py --out $o/bd_new --ms 1,16,64 --rounds 3 --breakdown
step bd_base $root/_ab/base 140 env ESCHA_GIT_SHA=7ec43bf python benchmarks/bench_decode_wgmma.py --out $o/bd_base --ms 1,16,64 --rounds 3 --breakdown
step host_new $root 60 env ESCHA_GIT_SHA=c2cb05d python benchmarks/bench_host.py --out $o/host_new.json --ms 1,16
step host_base $root/_ab/base 60 env ESCHA_GIT_SHA=7ec43bf python benchmarks/bench_host.py --out $o/host_base.json --ms 1,16
left=$((585 - (SECONDS - start)))
step tests $root $left python -m pytest -q -m "not slow" tests/test_transforms.py tests/test_dispatch.py tests/test_launch.py tests/test_decode_wgmma.py tests/test_norms.py tests/test_decode.py
tar -czf $OUT/c2.tgz -C /tmp c2
