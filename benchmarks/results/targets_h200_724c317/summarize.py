"""escha / bf16 cuBLAS and escha / fp8 cuBLAS at each token count of the three `targets` runs in
this folder (escha bench's results.json, one process a shape a run), against the issues' targets.

    python benchmarks/results/targets_h200_724c317/summarize.py   # writes table.md beside it
"""
import json
from pathlib import Path

HERE = Path(__file__).parent
TARGET = {1: 0.70, 8: 0.70, 16: 0.70, 40: 0.85, 64: 0.85, 128: 1.00, 256: 1.00}  # / bf16


def ratios(run: Path, shape: str) -> dict:
    rows = json.loads((run / f"bench_targets_{shape}" / "results.json").read_text())["rows"]
    us = {(r["M"], r["arm"]): r["us"] for r in rows}
    return {m: (us[(m, "escha")], us[(m, "escha")] / us[(m, "torch-bf16")], us[(m, "escha")] / us[(m, "torch-fp8")])
            for m in sorted({m for m, _ in us})}


def main() -> None:
    runs = sorted(p for p in HERE.glob("run*") if p.is_dir())
    out = [f"runs: {', '.join(r.name for r in runs)}; escha µs (median of the runs), escha / bf16 and "
           "escha / fp8 cuBLAS in each run", "",
           "| shape | M | escha µs | / bf16 (runs) | / fp8 (runs) | target / bf16 | verdict |", "|---|---|---|---|---|---|---|"]
    for shape in ("gate_up", "down"):
        per = [ratios(r, shape) for r in runs]
        for m in per[0]:
            t = sorted(p[m][0] for p in per)[len(per) // 2]
            b = [p[m][1] for p in per]
            f = [p[m][2] for p in per]
            target = TARGET.get(m)
            verdict = "" if target is None else ("met" if max(b) <= target else "missed" if min(b) > target else "split")
            out.append(f"| {shape} | {m} | {t:.1f} | {' / '.join(f'{x:.3f}' for x in b)} "
                       f"| {' / '.join(f'{x:.3f}' for x in f)} | {'' if target is None else f'≤ {target:.2f}'} | {verdict} |")
    text = "\n".join(out) + "\n"
    (HERE / "table.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
