#!/usr/bin/env bash
# The H200 measurement run: every GPU check and benchmark whose results are committed under
# benchmarks/results/. Usage (repository root, CUDA machine):
#   ESCHA_GIT_SHA=<commit> benchmarks/run_h200.sh PHASE OUT_DIR
# PHASE "kernels": GPU tests, decode and prefill benchmarks, compute-sanitizer.
# PHASE "check":   GPU tests, compute-sanitizer memcheck and racecheck on the reduced grid, and
#                  one layer's input side (bench_shared.py): one call of at most 10 minutes.
# PHASE "system":  escha bench (all arms), racecheck on a reduced grid.
# PHASE "sweep":   the dense M sweep of every escha path beside cuBLAS, one step per shape
#                  (SWEEP_SHAPES, default the seed's two), then benchmarks/fit_dispatch.py on it;
#                  then the register-operand kernel's split-K sweep and fit (fit_splitk.py).
# PHASE "e2e":     one layer's input side (bench_shared.py: separate, shared, folded norms, bf16),
#                  then end-to-end decode, Qwen3-14B-shaped: bf16, escha (q/k/v and gate/up as one
#                  product each, norms folded) and escha-unshared, with a profiled step per batch.
# PHASE "tp":      end-to-end decode at TP=2 against TP=1 (needs two GPUs; benchmarks/bench_e2e_tp.py).
# Each step has its own time limit, so one slow step cannot take the others' results with it.
set -uo pipefail
phase=${1:?phase: kernels, check, system, sweep, e2e or tp}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -d .whl ]; then  # optional peers (gemlite) carried as wheels
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log="$out/steps.log"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$log"
}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv;
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)";
  echo "git ${ESCHA_GIT_SHA:-unknown} date $(date -u +%FT%TZ)"; } > "$out/env.txt" 2>&1
case "$phase" in
  kernels)
    step gpu_tests 200 python -m pytest -q -m gpu tests
    step decode 200 python benchmarks/bench_decode.py --out "$out/decode" --ablate --sweep
    step prefill 150 python benchmarks/bench_prefill.py --out "$out/prefill"
    step sanitizer 200 benchmarks/run_sanitizer.sh "$out/sanitizer_h200.txt"
    ;;
  check)
    step gpu_tests 270 python -m pytest -q -m gpu tests
    step sanitizer 170 env ESCHA_SANITIZER_GRID=small benchmarks/run_sanitizer.sh "$out/sanitizer_small_h200.txt"
    step shared 120 python benchmarks/bench_shared.py --out "$out/shared"
    ;;
  system)
    ARMS=escha,torch-bf16,torch-fp8,triton-mxfp4,gemlite-w4,gemlite-w2,gemlite-mxfp4
    # Decode and prefill points as two runs, so a slow peer's tuning cannot cost both tables.
    step bench_decode 150 python -m escha.cli bench --arms "$ARMS" --m 1,8,16,40,64,128,256 --out "$out/bench_decode"
    step bench_prefill 110 python -m escha.cli bench --arms "$ARMS" --m 512,2048,8192 --out "$out/bench_prefill"
    step racecheck 70 env ESCHA_SANITIZER_TOOLS=racecheck ESCHA_SANITIZER_GRID=small \
      benchmarks/run_sanitizer.sh "$out/sanitizer_racecheck_h200.txt"
    ;;
  sweep)
    ARMS=escha,escha-decode,escha-decode-wgmma,escha-prefill,escha-dequant-fp8,torch-bf16,torch-fp8
    MS=1,2,4,8,16,24,32,48,64,96,128,192,256,384,512,768,1024,2048,4096,8192
    results=()
    IFS=, read -ra shapes <<< "${SWEEP_SHAPES:-gate_up,down}"
    for shape in "${shapes[@]}"; do
      name=${shape%%x*}
      step "sweep_$name" 280 python -m escha.cli bench --arms "$ARMS" --m "$MS" --shapes "$shape" \
        --out "$out/sweep_$name"
      f="$out/sweep_$name/results.json"
      [ -f "$f" ] || f="$out/sweep_$name/results.partial.json"  # a step cut by its limit keeps its points
      results+=("$f")
    done
    step fit_dispatch 60 python benchmarks/fit_dispatch.py "${results[@]}" --out "$out/fit_dispatch.md" \
      --json "$out/fit_dispatch.json"
    step splitk_wgmma 400 python benchmarks/fit_splitk.py --kernel decode-wgmma --out "$out"
    ;;
  e2e)
    step shared 200 python benchmarks/bench_shared.py --out "$out/shared"
    step e2e 500 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha,escha-unshared \
      --out "$out/e2e_h200.json"
    ;;
  tp)
    step e2e_tp2 1200 python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_e2e_tp.py \
      --arms bf16-tp,escha-tp,escha-tp1,bf16-tp1 --out "$out/e2e_tp2_h200.json"
    ;;
esac
tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
