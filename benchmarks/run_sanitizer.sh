#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel (benchmarks/sanitizer_cases.py).
# Usage: benchmarks/run_sanitizer.sh OUT_FILE   (run on a CUDA machine from the repository root)
# ESCHA_SANITIZER_TOOLS (default "memcheck racecheck") and ESCHA_SANITIZER_GRID=small (a reduced
# shape grid; racecheck is slow) narrow a run; ESCHA_SANITIZER_PRINT_LIMIT (default 50) is how many
# reports compute-sanitizer prints, enough to name the kernel of every hazard it counts.
# The exit status is benchmarks/sanitizer_verdict.py's, whose verdict ends the report: racecheck's
# reports inside cuBLAS's own GEMMs are listed there and do not fail the run; any memcheck error,
# any report in escha's kernels and any failed case do.
set -uo pipefail
out=${1:-sanitizer_report.txt}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# compute-sanitizer report"
  echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  echo "sanitizer: $(compute-sanitizer --version | tail -1)"
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "git: ${ESCHA_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  date: $(date -u +%FT%TZ)"
} > "$out"
for tool in ${ESCHA_SANITIZER_TOOLS:-memcheck racecheck}; do
  echo "## $tool (grid: ${ESCHA_SANITIZER_GRID:-full})" >> "$out"
  compute-sanitizer --tool "$tool" --print-limit "${ESCHA_SANITIZER_PRINT_LIMIT:-50}" --error-exitcode 99 \
      python benchmarks/sanitizer_cases.py >> "$out" 2>&1
  rc=$?
  echo "exit code: $rc" >> "$out"
done
python benchmarks/sanitizer_verdict.py "$out" >> "$out"
exit $?
