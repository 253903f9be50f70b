#!/usr/bin/env bash
# One device call (repository root, CUDA machine) for the fp8 decode GEMM's partials as bf16 pairs
# in the 64- and 128-token builds only (README.md). Before it, on the development machine:
#   benchmarks/snapshot_kernels.sh base REV   # REV: the tree before the change, the arm fp8@base
# and carry .prev (ignored). Steps: the GPU tests of the fp8 kernel and the transforms, the A/B at
# 72-256 tokens on three shapes, then memcheck and racecheck of the fp8 path (fp8-check's sanitizer
# steps). At most 600 s with TESTS_S=150 BENCH_S=200 SAN_S=110; ROUNDS, FP8_MS and SANITIZERS trim
# it, STEPS picks the steps (tests, bench, sanitizers).
set -uo pipefail
out=${1:-/tmp/fp8_pairs_blocks}
mkdir -p "$out"
log="$out/steps.log"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  case " ${STEPS:-tests bench sanitizers} " in *" ${name%%_*} "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$? seconds=$((SECONDS - t0))" | tee -a "$log"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > "$out/env.txt" 2>&1
step tests ${TESTS_S:-150} python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_fp8.py tests/test_transforms.py
step bench ${BENCH_S:-400} python benchmarks/bench_decode_fp8.py --out "$out/bench" --rounds "${ROUNDS:-5}" \
  --ms "${FP8_MS:-72,96,128,136,192,256}" --previous .prev/decode_fp8_base.py
for tool in ${SANITIZERS-memcheck racecheck}; do
  step "sanitizers_$tool" ${SAN_S:-150} env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 \
    ESCHA_SANITIZER_MS=1,100,130,300 ESCHA_SANITIZER_TOOLS=$tool benchmarks/run_sanitizer.sh "$out/sanitizers_$tool.txt"
done
