"""escha bench against bench_prefill.py on the same points, from one device call's two result files.

    python benchmarks/compare_harnesses.py BENCH_RESULTS.json PREFILL.json [--md OUT.md]

Pairs each ``escha bench`` row (arms escha, torch-bf16, torch-fp8) with the ``bench_prefill.py`` arm
that runs the same thing: the rule's path for ``escha`` (``escha.ops.DEFAULT_RULE.choose`` at that M
and K, as the named ``escha-<path>`` arm), ``cublas-bf16`` and ``cublas-fp8-rowwise`` for the
cuBLAS arms, and prints the ratio of the two medians.
"""
from __future__ import annotations

import argparse
import json

from escha.ops import DEFAULT_RULE

CUBLAS = {"torch-bf16": "cublas-bf16", "torch-fp8": "cublas-fp8-rowwise"}


def pairs(bench: dict, prefill: dict) -> list[tuple[str, int, str, float, str, float]]:
    """(shape, M, escha bench arm, µs, bench_prefill arm, µs) for every pair both files hold."""
    other = {(r["shape"], r["m"], r["arm"]): r["us"] for r in prefill["rows"]}
    out = []
    for r in bench["rows"]:
        if r["arm"] == "escha":
            arm = "escha-" + DEFAULT_RULE.choose(r["M"], in_features=r["K"]).value
        else:
            arm = CUBLAS.get(r["arm"])
        us = other.get((r["shape"], r["M"], arm))
        if us is not None:
            out.append((r["shape"], r["M"], r["arm"], r["us"], arm, us))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench")
    ap.add_argument("prefill")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    with open(args.bench) as f, open(args.prefill) as g:
        rows = pairs(json.load(f), json.load(g))
    lines = ["| shape | M | escha bench arm | µs | bench_prefill.py arm | µs | ratio |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {s} | {m} | {a} | {u:.1f} | {b} | {v:.1f} | {u / v:.3f} |" for s, m, a, u, b, v in rows]
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
