"""The A/B table of a run.sh result folder: each point's whole call against the tree before
(fp8@base) and bf16 cuBLAS, from bench/decode_fp8.json (medians of the interleaved rounds).

    python benchmarks/results/fp8_pairs_blocks/summarize.py RESULT_DIR   # writes RESULT_DIR/table.md
"""
import json
import sys
from pathlib import Path


def table(doc: dict) -> str:
    env = doc["env"]
    lines = [f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, git {env['git']}, {env['date']}",
             "", "| shape | M | build (tokens) | partials | bf16 cuBLAS | fp8@base | tree | tree / base | tree / bf16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    ratios = {}
    for p in doc["points"]:
        us, cfg = p["us"], p["config"]
        r = us["fp8"] / us["fp8@base"]
        ratios.setdefault(cfg["bf16_pairs"], []).append(r)
        lines.append(f"| {p['shape']} | {p['M']} | {cfg['block_tokens']} | {'bf16 pairs' if cfg['bf16_pairs'] else 'fp32'} "
                     f"| {us['cublas_bf16']:.1f} | {us['fp8@base']:.1f} | {us['fp8']:.1f} | {r:.3f} "
                     f"| {us['fp8'] / us['cublas_bf16']:.3f} |")
    lines.append("")
    for pairs, rs in sorted(ratios.items()):
        lines.append(f"tree / base, {'bf16 pairs' if pairs else 'fp32'} builds: {min(rs):.3f}-{max(rs):.3f} "
                     f"over {len(rs)} points")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    out = Path(sys.argv[1])
    text = table(json.loads((out / "bench" / "decode_fp8.json").read_text()))
    (out / "table.md").write_text(text)
    print(text, end="")
