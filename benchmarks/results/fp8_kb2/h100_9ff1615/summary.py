"""Tables of the two-k-block build (arm fp8, candidate.patch) against the build before it (fp8@9ff1615)
from this folder's runs: python summary.py > summary.md"""
import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "run*", "fp8_k[23]", "decode_fp8.json"))):
    d = json.load(open(path))
    for p in d["points"]:
        us = p["us"]
        if "fp8@9ff1615" in us:
            rows.setdefault((p["bits"], p["shape"], p["M"]), []).append(
                (os.path.relpath(path, here).split(os.sep)[0], us["fp8"], us["fp8@9ff1615"], us["cublas_bf16"]))
env = d["env"]
print(f"# Two k-blocks a step (fp8) against one (fp8@9ff1615), whole call, µs\n")
print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['git']}, {env['date'][:10]}; "
      "CUDA graphs, weights rotated past L2, medians; each run one process, arms interleaved.\n")
print("| K | shape | M | runs | fp8 (two) | fp8@9ff1615 (one) | two / one, each run | median | bf16 cuBLAS | two / bf16 |")
print("|---|---|---|---|---|---|---|---|---|---|")
for (bits, shape, m), rs in sorted(rows.items()):
    ratios = [a / b for _, a, b, _ in rs]
    two, one, bf16 = (statistics.median(r[i] for r in rs) for i in (1, 2, 3))
    print(f"| {bits} | {shape} | {m} | {len(rs)} | {two:.1f} | {one:.1f} | "
          f"{' '.join(f'{r:.3f}' for r in ratios)} | {statistics.median(ratios):.3f} | {bf16:.1f} | {two / bf16:.2f} |")
