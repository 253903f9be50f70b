"""The table of README.md from stream/probe_fp8_overlap.json (the run with every form):
    python benchmarks/results/fp8_overlap_h100/summarize.py"""
import json
import os

here = os.path.dirname(os.path.abspath(__file__))
d = json.load(open(os.path.join(here, "stream", "probe_fp8_overlap.json")))
print("| shape | M | whole | no_mma | no_decode | neither | stream | decode added | MMA added | neither + both added "
      "| activation MB | MB / us of neither |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for p in d["points"]:
    u = p["us"]
    dec, mma = u["no_mma"] - u["neither"], u["no_decode"] - u["neither"]
    mb = p["activation_bytes"] / 1e6
    print(f"| {p['shape']} | {p['M']} | {u['whole']:.1f} | {u['no_mma']:.1f} | {u['no_decode']:.1f} | {u['neither']:.1f} "
          f"| {u['stream']:.1f} | {dec:.1f} | {mma:.1f} | {u['neither'] + dec + mma:.1f} | {mb:.0f} | {mb / u['neither']:.1f} |")
