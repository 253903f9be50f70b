#!/usr/bin/env bash
# The activation pass of the prefill paths in one launch of the input transform (butterflies, a
# power-of-two scale per token from the row's max |x|), against main's two tensor-core passes, on
# one H200.
#
# Run from the repository root with the new tree as the working tree and the base tree's escha/
# and benchmarks/bench_prefill.py under _ab/base (untracked):
#   benchmarks/results/actquant_h200/ab_run.sh [OUT_DIR]   (default $OUT)
#   1. the GPU tests of the prefill, decode_fp8, dispatch and norms files on the new tree;
#   2. bench_prefill.py new / base / new at M = 512, 2048 and 8192 (no fused-prefill launch-shape
#      arms): the whole paths, every part, and the activation pass's launch-shape variants;
#   3. compute-sanitizer memcheck and racecheck of the prefill paths at 65, 130 and 2200 tokens
#      (2200: whole rows a program) on three shapes (tiles of 2, 1 and 4 blocks; 11 and 5 tiles
#      a row).
# Each step's output goes to OUT_DIR/<step>.txt, rc and seconds to OUT_DIR/steps.log, the
# environment to OUT_DIR/env.txt, and the new / base table to OUT_DIR/ab.md.
set -uo pipefail
o=${1:-${OUT:?give the output folder as \$1 or set OUT}}
new=$PWD; base=$PWD/_ab/base
mkdir -p "$o"
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd "$dir" && PYTHONPATH=$dir timeout "$limit" "$@" ) > "$o/$name.txt" 2>&1
  echo "$name rc=$? s=$((SECONDS - t0))" | tee -a "$o/steps.log"; }
[ -d "$base/escha" ] || { echo "no base tree under $base" | tee -a "$o/steps.log"; exit 2; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "new: ${ESCHA_GIT_SHA:-unknown}; base: ${BASE_SHA:-unknown}"
  echo "date $(date -u +%FT%TZ)"; } > "$o/env.txt" 2>&1

step tests "$new" 240 python -m pytest -q -m gpu tests/test_prefill.py tests/test_decode_fp8.py \
  tests/test_dispatch.py tests/test_norms.py

args=(--ms 512,2048,8192 --configs "" --rounds 5)
step bench_new1 "$new" 150 python benchmarks/bench_prefill.py --out "$o/new1" "${args[@]}"
step bench_base "$base" 150 python benchmarks/bench_prefill.py --out "$o/base" "${args[@]}"
step bench_new2 "$new" 150 python benchmarks/bench_prefill.py --out "$o/new2" "${args[@]}"

paths=dequant-fp8,dequant-core-fp8,dequant-bf16,dequant-core-bf16,prefill
for tool in memcheck racecheck; do
  step "sanitize_$tool" "$new" 170 env ESCHA_SANITIZER_GRID=small ESCHA_SANITIZER_PATHS=$paths \
    ESCHA_SANITIZER_MS=65,130,2200 ESCHA_SANITIZER_SHAPES=17x130,33x1300,40x2560 ESCHA_SANITIZER_TOOLS=$tool benchmarks/run_sanitizer.sh "$o/sanitizer_$tool.txt"
done

python - "$o" > "$o/ab.md" 2>&1 <<'EOF'
import json, os, sys
o = sys.argv[1]
runs = {}
for name in ("new1", "base", "new2"):
    try:
        with open(os.path.join(o, name, "prefill.json")) as f:
            runs[name] = {(r["shape"], r["m"], r["arm"]): r["us"] for r in json.load(f)["rows"]}
    except (OSError, ValueError, KeyError) as e:
        print(f"{name}: no result ({e!r})")
        runs[name] = {}
keys = sorted({k for r in runs.values() for k in r})
print("| shape | M | arm | new1 µs | base µs | new2 µs | new / base (mean of new) |")
print("|---|---|---|---|---|---|---|")
for k in keys:
    v = [runs[n].get(k) for n in ("new1", "base", "new2")]
    nv = [x for x in (v[0], v[2]) if x is not None]
    ratio = f"{sum(nv) / len(nv) / v[1]:.3f}" if nv and v[1] else "-"
    cells = " | ".join("-" if x is None else f"{x:.1f}" for x in v)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {cells} | {ratio} |")
EOF
cat "$o/steps.log"; tail -3 "$o/tests.txt"; grep -i "error\|hazard\|FAIL" "$o"/sanitizer_*.txt | tail -8; cat "$o/ab.md"
