#!/usr/bin/env bash
# K=3 at 32 and 64 tokens capped at 128 registers (4 programs an SM, against the rule's 3), on one
# H200 in one call (docs/KERNELS.md, "The loader candidate on the H200"). rule.patch (against the
# tree it sits in) makes the cap the rule's: decode_wgmma.REGISTER_CAPS / register_cap, and
# PROGRAMS_PER_SM (3, 32) and (3, 64) 3 -> 4; its sm_90a builds have no stack (offline, cuobjdump).
# Usage, repository root of main, on the H200:  benchmarks/results/k3_cap/run.sh OUT_DIR
#   1. bench_decode_wgmma.py --variants --bits 3 at 32 and 64 tokens (the cap128w4 arm beside the
#      rule's; every arm gated against fp64 before it is timed), on the unpatched tree;
#   2. in a patched copy: the GPU tests of test_decode_wgmma (the rule's configurations now capped),
#      and compute-sanitizer memcheck over them. About 4 minutes.
set -uo pipefail
o=${1:?output folder}
mkdir -p "$o"
export PYTHONUNBUFFERED=1
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$o/$name.txt" 2>&1; echo "$name rc=$? s=$((SECONDS - t0))" | tee -a "$o/steps.log"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git ${ESCHA_GIT_SHA:-unknown}; date $(date -u +%FT%TZ)"; } > "$o/env.txt" 2>&1
PYTHONPATH="$PWD" step bench_k3 150 python benchmarks/bench_decode_wgmma.py --out "$o/k3" --ms 32,40,64 \
  --shapes gate_up,down,down_8b --rounds 3 --variants --bits 3
copy=$(mktemp -d)
git ls-files -z | xargs -0 cp --parents -t "$copy" && cp -r benchmarks/results "$copy/benchmarks/"
(cd "$copy" && patch -p1 -s < benchmarks/results/k3_cap/rule.patch) || { echo "patch failed" | tee -a "$o/steps.log"; exit 2; }
cd "$copy" && export PYTHONPATH="$copy"
step gpu_tests 120 python -m pytest -q -m gpu tests/test_decode_wgmma.py
step memcheck 150 compute-sanitizer --tool memcheck --error-exitcode 99 python -m pytest -q -m gpu \
  tests/test_decode_wgmma.py -k "rule or within_tolerance"
grep -h "M=" "$o"/k3/decode_wgmma.log | sed -E 's/(cublas_bf16 +[0-9.]+ wgmma +[0-9.]+).*(cap128w4 +[0-9.]+).*/\1 \2/' \
  > "$o/summary.txt"
cat "$o/steps.log" "$o/summary.txt"
