"""The fp8 decode GEMM's call with its input transform in whole rows a program (arm fp8_in_rows,
DecodeFp8Config.input_shape) against the rule's one tile a program (arm fp8), from this folder's
runs: python summary.py > summary.md"""
import glob
import json
import os
import statistics

here = os.path.dirname(os.path.abspath(__file__))
rows = {}
for path in sorted(glob.glob(os.path.join(here, "run*", "fp8_input_k[23]", "decode_fp8.json"))):
    d = json.load(open(path))
    for p in d["points"]:
        us = p["us"]
        rows.setdefault((p["bits"], p["shape"], p["M"]), []).append((us["fp8_in_rows"], us["fp8"], us["cublas_bf16"]))
env = d["env"]
print("# Input transform in whole rows a program (fp8_in_rows) against the rule (fp8), whole call, µs\n")
print(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['git']}, {env['date'][:10]}; "
      "CUDA graphs, weights rotated past L2, medians; each run one process, arms interleaved.\n")
print("| K | shape | M | runs | fp8_in_rows | fp8 (rule) | rows / rule, each run | median | bf16 cuBLAS |")
print("|---|---|---|---|---|---|---|---|---|")
for (bits, shape, m), rs in sorted(rows.items()):
    ratios = [a / b for a, b, _ in rs]
    a, b, c = (statistics.median(r[i] for r in rs) for i in range(3))
    print(f"| {bits} | {shape} | {m} | {len(rs)} | {a:.1f} | {b:.1f} | {' '.join(f'{r:.3f}' for r in ratios)} | "
          f"{statistics.median(ratios):.3f} | {c:.1f} |")
