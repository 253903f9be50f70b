#!/usr/bin/env bash
# One device call for the candidate (repository root, CUDA machine, the patch applied with
# `git apply benchmarks/results/fp8_bf16_partials/candidate.patch`, and the file it replaces saved
# in an ignored folder the call carries: mkdir -p .prev_fp8 && git show 1005731:escha/kernels/decode_fp8.py
# > .prev_fp8/decode_fp8_1005731.py). About 480 s: the fp8 GPU tests and the A/B (fp8-ab), then
# memcheck and racecheck of the fp8 path (fp8-check's sanitizer steps).
set -uo pipefail
out=${1:-/tmp/fp8_bf16}
FP8_PREVIOUS=.prev_fp8/decode_fp8_1005731.py FP8_MS=${FP8_MS:-96,128,192,256} benchmarks/run_h200.sh fp8-ab "$out/ab"
for tool in memcheck racecheck; do
  env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 \
    ESCHA_SANITIZER_TOOLS=$tool benchmarks/run_sanitizer.sh "$out/sanitizer_$tool.txt"
done
