"""Fit escha.matmul's path rule from a dense `escha bench` sweep, and report what it loses.

    python benchmarks/fit_dispatch.py RESULTS.json [RESULTS.json ...] [--out FIT.md] [--json FIT.json]

Input: results.json files of ``escha bench --arms escha,escha-*,torch-bf16,torch-fp8 --m ...``
(one row per arm, shape and M; the ``escha-<path>`` rows are the candidates, ``escha`` is the rule
in force when the sweep ran, the torch rows the cuBLAS references).

The rule may depend on M only (no per-shape table), as ``escha.ops.DispatchRule`` does. For each M
the fit takes the candidate path whose worst loss over the shapes is smallest (loss: its time over
the fastest candidate's at that shape and M, minus one), then merges neighbouring M with the same
path into ranges. The report gives, at every point: the fitted path and its loss, the rule in
force (``escha``) and its loss, and both against bf16 and fp8 cuBLAS (issue targets: at most
1.00x bf16 at every M, at most 1.15x fp8 at M >= 2048 and 1.30x at M = 512), and the ranges as
``DispatchRule`` thresholds when they take the order it expresses (``as_dispatch_rule``).

Candidates are the fp8-precision paths (``decode``, ``decode-wgmma``, ``prefill``, ``decode-fp8``,
``dequant-core-fp8``, ``dequant-fp8``); the two dequantize-once forms count as one stage of the rule, chosen between by
rows per 128 inputs (``core_m_per_kblock``, fitted over the points where both ran);
``dequant-core-bf16`` and ``dequant-bf16`` are what ``precision="bf16"`` selects (by the same
rows per 128 inputs), and ``reference`` is not a kernel.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

CANDIDATES = ("decode", "decode-wgmma", "prefill", "decode-fp8", "dequant-core-fp8", "dequant-fp8")
DEQUANT_FORMS = ("dequant-core-fp8", "dequant-fp8")  # chosen between by K (DispatchRule.dequant_path)
RULE_ARM = "escha"
PREFIX = "escha-"
BF16_ARM, FP8_ARM = "torch-bf16", "torch-fp8"


@dataclass(frozen=True)
class Point:
    """One (shape, M) of the sweep: each arm's median µs (passing rows only)."""

    shape: str
    m: int
    us: dict[str, float]
    k: int = 0  # in_features (the dequantize-once forms are chosen between by K)

    def best(self, paths: tuple[str, ...]) -> float:
        times = [self.us[p] for p in paths if p in self.us]
        return min(times) if times else math.nan


def load_points(docs: list[dict]) -> list[Point]:
    """Points from results.json documents; a (shape, M) seen in two files is refused."""
    table: dict[tuple[str, int], dict[str, float]] = {}
    ks: dict[str, int] = {}
    seen: dict[tuple[str, int, str], int] = {}
    for i, doc in enumerate(docs):
        for row in doc["rows"]:
            key = (row["shape"], row["M"], row["arm"])
            if key in seen:
                raise ValueError(f"{row['arm']} at {row['shape']} M={row['M']} appears in inputs {seen[key]} and {i}")
            seen[key] = i
            ks[row["shape"]] = int(row.get("K", 0))
            if row["gate"] == "pass" and row["us"] is not None:
                name = row["arm"][len(PREFIX):] if row["arm"].startswith(PREFIX) else row["arm"]
                table.setdefault((row["shape"], row["M"]), {})[name] = float(row["us"])
    return [Point(s, m, us, ks[s]) for (s, m), us in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def fit(points: list[Point], candidates: tuple[str, ...] = CANDIDATES) -> list[tuple[int, int, str]]:
    """Ranges (m_lo, m_hi, path) over the measured M: at each M the candidate with the smallest
    worst loss over the shapes that measured it (a path missing at a shape cannot be chosen)."""
    chosen: list[tuple[int, str]] = []
    for m in sorted({p.m for p in points}):
        at_m = [p for p in points if p.m == m]
        best_path, best_worst = None, math.inf
        for path in candidates:
            if any(path not in p.us for p in at_m):
                continue
            worst = max(p.us[path] / p.best(candidates) - 1 for p in at_m)
            if worst < best_worst:
                best_path, best_worst = path, worst
        if best_path is None:
            raise ValueError(f"no candidate path was measured at every shape at M={m}")
        chosen.append((m, best_path))
    ranges: list[tuple[int, int, str]] = []
    for m, path in chosen:
        if ranges and ranges[-1][2] == path:
            ranges[-1] = (ranges[-1][0], m, path)
        else:
            ranges.append((m, m, path))
    return ranges


def path_at(ranges: list[tuple[int, int, str]], m: int) -> str:
    """The fitted path at a measured M."""
    for lo, hi, path in ranges:
        if lo <= m <= hi:
            return path
    raise KeyError(m)


DECODE_PATHS = ("decode", "decode-wgmma")


def as_dispatch_rule(ranges: list[tuple[int, int, str]]) -> dict | None:
    """The ``escha.ops.DispatchRule`` thresholds the ranges amount to, when they take the order
    the rule can express (decode paths, then the fused prefill kernel, then the fp8 decode GEMM,
    then dequantize-once), else None. A lower threshold between two measured M is put at the
    smaller one's next integer; ``fp8_decode_max_m`` at the last M the fp8 decode GEMM took (0:
    none)."""
    order = {"decode": 0, "decode-wgmma": 0, "prefill": 1, "decode-fp8": 2, "dequant-core-fp8": 3, "dequant-fp8": 3}
    stages = [order[p] for _, _, p in ranges]
    if stages != sorted(stages):
        return None
    decode_max = max((hi for _, hi, p in ranges if p in DECODE_PATHS), default=0)
    # dequant_min_m starts the stages after the fused kernel: the fp8 decode GEMM, then dequantize-once.
    dequant_min = min((lo for lo, _, p in ranges if order[p] >= 2), default=None)
    prefill_hi = max((hi for _, hi, p in ranges if p == "prefill"), default=None)
    fp8_max = max((hi for _, hi, p in ranges if p == "decode-fp8"), default=0)
    if dequant_min is None:  # no later range measured: the fused kernel takes every larger M
        dequant_min = 2**31 - 1
    elif prefill_hi is not None or decode_max:
        dequant_min = (prefill_hi if prefill_hi is not None else decode_max) + 1
    return {"decode_max_m": decode_max, "dequant_min_m": dequant_min, "fp8_decode_max_m": fp8_max}


def fit_core_m_per_kblock(points: list[Point], dequant_min_m: int) -> tuple[int, float] | None:
    """``DispatchRule.core_m_per_kblock`` (the plain-core form up to that many rows per 128 inputs,
    the folded form above) with the smallest worst loss against the faster form over the points
    at M >= dequant_min_m that measured both, and that loss; None without such points."""
    pts = [p for p in points if p.m >= dequant_min_m and all(f in p.us for f in DEQUANT_FORMS) and p.k > 0]
    if not pts:
        return None
    kblocks = lambda p: -(-p.k // 128)  # noqa: E731
    best: tuple[int, float] | None = None
    for c in sorted({0} | {p.m // kblocks(p) for p in pts}):
        worst = max(p.us[DEQUANT_FORMS[0] if p.m <= c * kblocks(p) else DEQUANT_FORMS[1]]
                    / min(p.us[f] for f in DEQUANT_FORMS) - 1 for p in pts)
        if best is None or worst < best[1]:
            best = (c, worst)
    return best


def report(points: list[Point], ranges: list[tuple[int, int, str]],
           candidates: tuple[str, ...] = CANDIDATES) -> dict:
    """Every point's fitted path and losses, and the worst of each column."""
    rows = []
    for p in points:
        path = path_at(ranges, p.m)
        best = p.best(candidates)
        row = {"shape": p.shape, "M": p.m, "best_path": min((c for c in candidates if c in p.us), key=p.us.get),
               "best_us": best, "fitted_path": path, "fitted_us": p.us[path], "fitted_loss": p.us[path] / best - 1}
        if RULE_ARM in p.us:
            row["rule_us"] = p.us[RULE_ARM]
            row["rule_loss"] = p.us[RULE_ARM] / best - 1
        for arm, key in ((BF16_ARM, "vs_bf16"), (FP8_ARM, "vs_fp8")):
            if arm in p.us:
                row[key] = p.us[path] / p.us[arm]
        rows.append(row)
    worst = {k: max((r[k] for r in rows if k in r), default=None)
             for k in ("fitted_loss", "rule_loss", "vs_bf16")}
    rule = as_dispatch_rule(ranges)
    core = None if rule is None else fit_core_m_per_kblock(points, rule["dequant_min_m"])
    if core is not None:
        rule = {**rule, "core_m_per_kblock": core[0]}
    return {"ranges": [{"m_from": lo, "m_to": hi, "path": path} for lo, hi, path in ranges],
            "dispatch_rule": rule, "core_form_worst_loss": None if core is None else core[1],
            "worst": worst, "points": rows}


def markdown(fitted: dict) -> str:
    out = ["## Fitted rule (M only)", ""]
    out += [f"- M {r['m_from']}..{r['m_to']} (measured points): `{r['path']}`" for r in fitted["ranges"]]
    rule = fitted["dispatch_rule"]
    if rule is None:
        out += ["", "The ranges do not take the order DispatchRule can express (decode, prefill, dequant-fp8)."]
    else:
        core = (f", core_m_per_kblock={rule['core_m_per_kblock']}" if "core_m_per_kblock" in rule else "")
        out += ["", f"As `escha.ops.DispatchRule`: `DispatchRule(decode_max_m={rule['decode_max_m']}, "
                    f"dequant_min_m={rule['dequant_min_m']}{core}, fp8_decode_max_m={rule['fp8_decode_max_m']})` "
                    f"(inside the decode range, the register-operand kernel wherever it runs, else the portable "
                    f"one; between the two dequantize-once forms, `DispatchRule.dequant_path` by K)."]
        if fitted.get("core_form_worst_loss") is not None:
            out += ["", f"The K-proportional choice between the dequantize-once forms loses at most "
                        f"{100 * fitted['core_form_worst_loss']:.1f}% against the faster form where both ran."]
    w = fitted["worst"]
    fmt = lambda v: "–" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    out += ["", f"Worst loss against the fastest path: fitted {fmt(w['fitted_loss'])}, "
                f"rule in force {fmt(w['rule_loss'])}.", "",
            "| shape | M | fastest path (µs) | fitted path (µs) | loss | rule in force (µs) | loss | fitted / bf16 | fitted / fp8 |",
            "|---|---|---|---|---|---|---|---|---|"]
    num = lambda r, k, f: f.format(r[k]) if k in r else "–"  # noqa: E731
    for r in fitted["points"]:
        out.append(f"| {r['shape']} | {r['M']} | {r['best_path']} ({r['best_us']:.1f}) | {r['fitted_path']} "
                   f"({r['fitted_us']:.1f}) | {100 * r['fitted_loss']:.1f}% | {num(r, 'rule_us', '{:.1f}')} | "
                   f"{num(r, 'rule_loss', '{:.1%}')} | {num(r, 'vs_bf16', '{:.2f}x')} | {num(r, 'vs_fp8', '{:.2f}x')} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="escha bench results.json files")
    ap.add_argument("--out", type=Path, help="write the markdown report here")
    ap.add_argument("--json", type=Path, help="write the fit as JSON here")
    args = ap.parse_args(argv)
    try:
        points = load_points([json.loads(p.read_text()) for p in args.results])
        ranges = fit(points)
    except (OSError, ValueError, KeyError) as e:
        print(f"fit_dispatch: {e}", file=sys.stderr)
        return 2
    fitted = report(points, ranges)
    text = markdown(fitted)
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"inputs": [str(p) for p in args.results], **fitted}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
