"""A summary table of ncu's text reports of one kernel: what bounds it, in one row a report.

    python benchmarks/ncu_summary.py REPORT.txt [REPORT.txt ...] [--md OUT.md]

Each report is the text ``ncu --set full --metrics 'regex:smsp__average_warps_issue_stalled_.*'``
prints for one launch (``run_h200.sh ncu-loop``'s ``ncu_gemm_gate_up_m<M>.txt``). A row: the grid,
registers a thread, the programs an SM (the tightest block limit, and which), achieved occupancy,
active and eligible warps a scheduler, issue slots busy (the share of cycles a scheduler issues),
warp cycles per issued instruction, the SM clock, the duration, and the leading stall reasons in
warp cycles per issued instruction (ncu's ``smsp__average_warps_issue_stalled_<reason>_per_issue_active``;
"selected" is the issue itself). The row's label is the report's file name after its last ``_m``
(``m8``), or the whole name.
"""
from __future__ import annotations

import argparse
import os
import re

STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)")
ROW = re.compile(r"^\s{4}(\S.*?)\s{2,}(\S+)?\s+([\d.,]+)\s*$")  # "    Name   unit   value"
LAUNCH = re.compile(r"^\s{2}(\w+) \((\d+), (\d+), (\d+)\)x\((\d+), (\d+), (\d+)\)")
LIMITS = ("Registers", "Shared Mem", "Warps", "SM", "Barriers")


def number(text: str) -> float:
    """A report's number (thousands separated by commas)."""
    return float(text.replace(",", ""))


def parse(text: str) -> dict:
    """The metrics of one report: {name: value} for every "name unit value" row (the first of a
    name), the stall reasons {reason: warp cycles per issued instruction}, the kernel and grid."""
    metrics: dict[str, float] = {}
    stalls: dict[str, float] = {}
    kernel, grid = None, None
    for line in text.splitlines():
        m = STALL.search(line)
        if m:
            stalls[m.group(1)] = number(m.group(2))
            continue
        m = LAUNCH.match(line)
        if m and kernel is None:
            kernel = m.group(1)
            grid = tuple(int(v) for v in m.group(2, 3, 4)), tuple(int(v) for v in m.group(5, 6, 7))
            continue
        m = ROW.match(line)
        if m:
            metrics.setdefault(m.group(1).strip(), number(m.group(3)))
    if kernel is None:
        raise ValueError("no kernel launch line (\"  name (x, y, z)x(x, y, z)\") in the report")
    return {"kernel": kernel, "grid": grid, "metrics": metrics, "stalls": stalls}


def summary_row(report: dict, top: int = 5) -> dict:
    """The table's fields of one parsed report."""
    m = report["metrics"]
    limits = {name: m[f"Block Limit {name}"] for name in LIMITS if f"Block Limit {name}" in m}
    per_sm = min(limits.values()) if limits else None
    bound = [name.lower() for name, v in limits.items() if v == per_sm]
    stalls = sorted(((k, v) for k, v in report["stalls"].items() if k != "selected"), key=lambda kv: -kv[1])
    (gx, gy, gz), (bx, by, bz) = report["grid"]
    return {"kernel": report["kernel"], "grid": f"{gx} x {gy}" + (f" x {gz}" if gz > 1 else ""),
            "threads": bx * by * bz, "registers": m.get("Registers Per Thread"),
            "programs_per_sm": per_sm, "bound_by": bound,
            "achieved_occupancy_pct": m.get("Achieved Occupancy"),
            "active_warps": m.get("Active Warps Per Scheduler"), "eligible_warps": m.get("Eligible Warps Per Scheduler"),
            "issue_slots_busy_pct": m.get("Issue Slots Busy"), "one_or_more_eligible_pct": m.get("One or More Eligible"),
            "cycles_per_issue": m.get("Warp Cycles Per Issued Instruction"), "sm_ghz": m.get("SM Frequency"),
            "duration_us": m.get("Duration"), "stalls": stalls[:top]}


def label(path: str) -> str:
    """The row's name: what follows the file name's last "_m" (its token count), or the name."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return "m" + stem.rsplit("_m", 1)[1] if "_m" in stem else stem


def markdown(rows: list[tuple[str, dict]]) -> str:
    """The rows as a markdown table."""
    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    lines = ["| report | kernel | grid | registers | programs an SM (limit) | achieved occupancy | active / eligible "
             "warps a scheduler | issue slots busy | cycles an issued instruction | SM clock | duration | leading "
             "stalls (warp cycles an issued instruction) |", "|" + "---|" * 12]
    for name, r in rows:
        stalls = ", ".join(f"{k} {v:.2f}" for k, v in r["stalls"])
        lines.append(f"| {name} | {r['kernel']} | {r['grid']} | {f(r['registers'], '{:.0f}')} | "
                     f"{f(r['programs_per_sm'], '{:.0f}')} ({', '.join(r['bound_by']) or '-'}) | "
                     f"{f(r['achieved_occupancy_pct'], '{:.1f}%')} | {f(r['active_warps'])} / {f(r['eligible_warps'])} | "
                     f"{f(r['issue_slots_busy_pct'], '{:.1f}%')} | {f(r['cycles_per_issue'])} | "
                     f"{f(r['sm_ghz'], '{:.2f} GHz')} | {f(r['duration_us'], '{:.1f} µs')} | {stalls} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--md", help="write the table here too")
    ap.add_argument("--top", type=int, default=5, help="stall reasons a row (default 5)")
    args = ap.parse_args()
    rows = []
    for path in args.reports:
        with open(path) as fh:
            rows.append((label(path), summary_row(parse(fh.read()), args.top)))
    table = markdown(rows)
    print(table, end="")
    if args.md:
        with open(args.md, "w") as fh:
            fh.write(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
