#!/usr/bin/env bash
# Branch codec-fma (codec.window16_ptx takes the state's high 16 bits with mul.hi.u32 by 2**16 on
# the FMA pipe, where main shifts right by 16 on the ALU pipe) against main, on one H200.
#
# Run from the repository root with the branch as the working tree and main copied under
# _ab/base (untracked):  benchmarks/results/codec_fma/ab_run.sh [OUT_DIR]   (default $OUT)
#   1. the codec's, dequantize kernels' and prefill's GPU tests on the branch (the PTX codec
#      bit-exact against the Triton codec and the reference);
#   2. bench_prefill.py new / base / new, interleaved, at M = 512 and 2048 without the prefill
#      launch-shape arms (--configs ""): every part-dequant-* arm (the dequantize kernels that
#      carry the codec) and the escha-dequant-* paths, both shapes.
# Expected about 3-4 minutes (cold Triton caches for both trees); each step is under timeout.
# Each step's output goes to OUT_DIR/<step>.txt, rc and seconds to OUT_DIR/steps.log, the
# environment to OUT_DIR/env.txt, and the new / base table of the dequantize arms to OUT_DIR/ab.md.
set -uo pipefail
o=${1:-${OUT:?give the output folder as \$1 or set OUT}}
new=$PWD; base=$PWD/_ab/base
mkdir -p "$o"
export PYTHONUNBUFFERED=1
step() { local name=$1 dir=$2 limit=$3; shift 3; local t0=$SECONDS
  ( cd "$dir" && PYTHONPATH=$dir timeout "$limit" "$@" ) > "$o/$name.txt" 2>&1
  echo "$name rc=$? s=$((SECONDS - t0))" >> "$o/steps.log"; }
[ -d "$base/escha" ] || { echo "no main tree under $base" | tee -a "$o/steps.log"; exit 2; }

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "new: codec-fma ${ESCHA_GIT_SHA:-unknown}; base: main ${BASE_SHA:-$(git -C "$base" rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "date $(date -u +%FT%TZ)"; } > "$o/env.txt" 2>&1

tests=$(cd "$new" && ls tests/test_codec_kernels.py tests/test_dequant*.py tests/test_prefill*.py 2>/dev/null)
step tests "$new" 150 python -m pytest -q -m gpu $tests

args=(--ms 512,2048 --configs "" --rounds 5)
step bench_new1 "$new" 110 python benchmarks/bench_prefill.py --out "$o/new1" "${args[@]}"
step bench_base "$base" 110 python benchmarks/bench_prefill.py --out "$o/base" "${args[@]}"
step bench_new2 "$new" 90 python benchmarks/bench_prefill.py --out "$o/new2" "${args[@]}"

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
keys = sorted({k for r in runs.values() for k in r if "dequant" in k[2]})
print("| shape | M | arm | new1 µs | base µs | new2 µs | new / base (mean of new) |")
print("|---|---|---|---|---|---|---|")
for k in keys:
    v = [runs[n].get(k) for n in ("new1", "base", "new2")]
    nv = [x for x in (v[0], v[2]) if x is not None]
    ratio = f"{sum(nv) / len(nv) / v[1]:.3f}" if nv and v[1] else "-"
    cells = " | ".join("-" if x is None else f"{x:.1f}" for x in v)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {cells} | {ratio} |")
EOF
cat "$o/steps.log"; tail -3 "$o/tests.txt"; cat "$o/ab.md"
