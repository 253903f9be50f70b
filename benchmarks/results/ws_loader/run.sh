#!/usr/bin/env bash
# The decode GEMM with its TMA copies in a loader warp (gl.warp_specialize), against the rule, on
# one H200 in one call (docs/KERNELS.md, "CTA barriers in the loop"). The candidate is
# candidate.patch (the kernel _decode_wgmma_ws_kernel behind DecodeWgmmaConfig.loader, its tests,
# bench_decode_wgmma's loader_c64 / loader_c48 variants); offline it compiles for sm_90a with 2
# bar.sync a decoding step against the rule's 4-5, and its CPU tests pass. Run once on the H200
# (h200_cb854b2/): it failed its bitwise test.
# Usage, repository root of main, on the H200:  benchmarks/results/ws_loader/run.sh OUT_DIR
#   1. apply the patch (to this copy of the tree);
#   2. its GPU tests: bitwise the rule kernel's output (test_loader_partition_gives_the_same_bits)
#      and the rest of test_decode_wgmma; diag.py, which places any difference (h200_cb854b2/:
#      the first run failed the bitwise test at 7 of 12 points);
#   3. compute-sanitizer memcheck and racecheck over ws_cases.py;
#   4. bench_decode_wgmma.py --variants, K=2 (gate_up, down, down_8b at 1, 8, 16, 64 tokens) and
#      K=3 (gate_up, down at 8, 64): the loader arms beside the rule's. About 7 minutes in all.
set -uo pipefail
o=${1:?output folder}
mkdir -p "$o"
here=benchmarks/results/ws_loader
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS
  timeout "$limit" "$@" > "$o/$name.txt" 2>&1; echo "$name rc=$? s=$((SECONDS - t0))" | tee -a "$o/steps.log"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git ${ESCHA_GIT_SHA:-unknown} + candidate.patch; date $(date -u +%FT%TZ)"; } > "$o/env.txt" 2>&1
{ patch -p1 < "$here/candidate.patch" || git apply "$here/candidate.patch"; } > "$o/patch.txt" 2>&1 \
  || { echo "patch failed" | tee -a "$o/steps.log"; exit 2; }
step gpu_tests 70 python -m pytest -q -m gpu tests/test_decode_wgmma.py -k "loader or variants"
step cpu_ptx 45 python -m pytest -q tests/test_decode_wgmma.py -k "loader_partition_ptx"
step diag 150 python "$here/diag.py"  # where the outputs differ (the run at cb854b2 failed the bitwise test)
step memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 99 python "$here/ws_cases.py"
step racecheck 100 compute-sanitizer --tool racecheck --error-exitcode 99 python "$here/ws_cases.py"
step bench_k2 130 python benchmarks/bench_decode_wgmma.py --out "$o/k2" --ms 1,8,16,64 \
  --shapes gate_up,down,down_8b --rounds 3 --variants
step bench_k3 50 python benchmarks/bench_decode_wgmma.py --out "$o/k3" --ms 8,64 --shapes gate_up,down \
  --rounds 3 --variants --bits 3
grep -h "M=" "$o"/k2/decode_wgmma.log "$o"/k3/decode_wgmma.log 2>/dev/null \
  | sed -E 's/(cublas_bf16 +[0-9.]+ wgmma +[0-9.]+).*(loader_c64 +[0-9.]+)( loader_c48 +[0-9.]+)?.*/\1 \2\3/' > "$o/summary.txt"
cat "$o/steps.log" "$o/summary.txt"
