#!/usr/bin/env bash
# One device call (repository root, CUDA machine) for the fp8 decode GEMM's partials as bf16 pairs
# (README.md). Before it, on the development machine:
#   benchmarks/snapshot_kernels.sh base HEAD        # the tree's kernels, the arm fp8@base
#   git apply benchmarks/results/fp8_bf16_pairs/candidate.patch
#   python benchmarks/results/fp8_bf16_pairs/make_b16.py   # the two-16-bit-store form, fp8@b16
# and carry .prev (ignored). Steps: the fp8 GPU tests (with the norms', the dispatcher's and the
# transforms'), the A/B at 72-256 tokens on three shapes (PREVIOUS_MORE=.prev/decode_fp8_b16.py adds
# that arm), the GEMM and the output transform each alone against the base copies (parts.py), then
# memcheck and racecheck of the fp8 path (fp8-check's sanitizer steps). About 480 s; TESTS_S,
# ROUNDS, FP8_MS and SANITIZERS trim it.
set -uo pipefail
out=${1:-/tmp/fp8_pairs}
mkdir -p "$out"
log="$out/steps.log"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - t0))" | tee -a "$log"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > "$out/env.txt" 2>&1
step gpu_tests_fp8 ${TESTS_S:-200} python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_fp8.py tests/test_dispatch.py \
  tests/test_norms.py tests/test_transforms.py
step bench_fp8 330 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8" --rounds "${ROUNDS:-5}" \
  --ms "${FP8_MS:-72,96,128,192,256}" --previous .prev/decode_fp8_base.py${PREVIOUS_MORE:+,$PREVIOUS_MORE}
step parts 120 python benchmarks/results/fp8_bf16_pairs/parts.py "$out/parts"
for tool in ${SANITIZERS-memcheck racecheck}; do
  step "sanitizer_$tool" 150 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 \
    ESCHA_SANITIZER_MS=1,100,130,300 ESCHA_SANITIZER_TOOLS=$tool benchmarks/run_sanitizer.sh "$out/sanitizer_$tool.txt"
done
