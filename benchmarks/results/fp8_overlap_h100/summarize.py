"""The tables of README.md: python benchmarks/results/fp8_overlap_h100/summarize.py
parts/ (every form but the partials' layouts, 96-256 tokens) and layout/ (all, 128 and 256)."""
import json
import os

here = os.path.dirname(os.path.abspath(__file__))


def load(run):
    return json.load(open(os.path.join(here, run, "probe_fp8_overlap.json")))["points"]


print("| shape | M | whole | no_mma | no_decode | neither | stream | no_stream | no_store | no_stream_no_store "
      "| whole − no_stream | whole − no_store |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for p in load("parts"):
    u = p["us"]
    print(f"| {p['shape']} | {p['M']} | " + " | ".join(f"{u[k]:.1f}" for k in (
        "whole", "no_mma", "no_decode", "neither", "stream", "no_stream", "no_store", "no_stream_no_store"))
        + f" | {u['whole'] - u['no_stream']:.1f} | {u['whole'] - u['no_store']:.1f} |")
print()
print("| shape | M | whole | no_store | tokens | tokens4 | tokens4 / whole |")
print("|---|---|---|---|---|---|---|")
for p in load("layout"):
    u = p["us"]
    print(f"| {p['shape']} | {p['M']} | {u['whole']:.1f} | {u['no_store']:.1f} | {u['tokens']:.1f} | {u['tokens4']:.1f} "
          f"| {u['tokens4'] / u['whole']:.3f} |")
