#!/usr/bin/env bash
# One device call (repository root, CUDA machine): the register-operand decode GEMM's 64-token
# build under the rule (128 registers, 4 programs an SM) against the same build capped at 168
# (167 registers, 3 an SM: bench_decode_wgmma.py's `cap168` arm) at 40, 48 and 64 tokens on six
# shapes (two Qwen3-14B-shaped, two Llama-3-8B, two tensor-parallel shards), five interleaved
# rounds, with PREVIOUS (comma-separated .prev/decode_wgmma_LABEL.py, e.g. the rule with that cap
# made by snapshot_kernels.sh and SED) timed beside as arms wgmma@LABEL; then, in what time is
# left, the 512- and 2048-token prompts of the Qwen3-14B-shaped model under the torch profiler
# (bench_e2e.py --profile-prefill). VARIANTS_S, PROFILE_S: limits.
set -uo pipefail
out=${1:-/tmp/caps64}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > "$out/env.txt" 2>&1
t0=$SECONDS
timeout "${VARIANTS_S:-130}" python benchmarks/bench_decode_wgmma.py --out "$out/variants" --ms 40,48,64 \
  --shapes gate_up,down,qkv_8b,down_8b,o_tp2,qkv_tp4 --rounds 5 --variants \
  ${PREVIOUS:+--previous "$PREVIOUS"} > "$out/variants.txt" 2>&1
echo "variants rc=$? seconds=$((SECONDS - t0))" | tee -a "$out/steps.log"
t0=$SECONDS
timeout "${PROFILE_S:-140}" python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --batches 1 \
  --new-tokens 8 --repeats 1 --no-profile --profile-prefill 512,2048 \
  --out "$out/e2e_prefill_profile_h200.json" > "$out/prefill_profile.txt" 2>&1
echo "prefill_profile rc=$? seconds=$((SECONDS - t0))" | tee -a "$out/steps.log"
