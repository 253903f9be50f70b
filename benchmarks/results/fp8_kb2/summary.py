"""Tables of the two-k-block build (arm fp8, candidate.patch) against the build before it (the arm
fp8@REV) from one folder's runs (run*/fp8_k2 and fp8_k3): python summary.py DIR > DIR/summary.md"""
import glob
import json
import os
import statistics
import sys

here = os.path.abspath(sys.argv[1])
rows, label = {}, None
for path in sorted(glob.glob(os.path.join(here, "run*", "fp8_k[23]", "decode_fp8.json"))):
    d = json.load(open(path))
    for p in d["points"]:
        us = p["us"]
        before = [k for k in us if k.startswith("fp8@")]
        if before:
            label = before[0]
            rows.setdefault((p["bits"], p["shape"], p["M"]), []).append(
                (os.path.relpath(path, here).split(os.sep)[0], us["fp8"], us[label], us["cublas_bf16"]))
env = d["env"]
print(f"# Two k-blocks a step (fp8) against one ({label}), whole call, µs\n")
print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['git']}, {env['date'][:10]}; "
      "CUDA graphs, weights rotated past L2, medians; each run one process, arms interleaved.\n")
print(f"| K | shape | M | runs | fp8 (two) | {label} (one) | two / one, each run | median | bf16 cuBLAS | two / bf16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (bits, shape, m), rs in sorted(rows.items()):
    ratios = [a / b for _, a, b, _ in rs]
    two, one, bf16 = (statistics.median(r[i] for r in rs) for i in (1, 2, 3))
    print(f"| {bits} | {shape} | {m} | {len(rs)} | {two:.1f} | {one:.1f} | "
          f"{' '.join(f'{r:.3f}' for r in ratios)} | {statistics.median(ratios):.3f} | {bf16:.1f} | {two / bf16:.2f} |")
