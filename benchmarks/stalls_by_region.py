"""Where a GEMM's warps spend their cycles, by kind of instruction: ncu's warp-state samples per
SASS instruction (a CSV of ``ncu -i REP --page source --print-source sass --csv``, optionally
gzipped; ``benchmarks/ncu_sass.sh`` writes them) summed by what each instruction does, with each
kind's leading stall reasons, and the instructions that hold the most samples.

    python benchmarks/stalls_by_region.py SASS.csv[.gz] [--top 20]

A sample is a warp seen at that instruction (issuing or stalled), so a kind's share of the samples
is its share of the warps' time. Kinds: the mbarrier wait on the TMA ring (the try-wait, the
branch on its result and the out-of-line retry loop), CTA barriers, the wait for the MMAs
(WARPGROUP.DEPBAR), the MMA issue, word loads (shared or global), the codec and the other
per-thread arithmetic, the uniform datapath (descriptors, counters, the refill's bookkeeping), the
TMA copies and their fences, the tile-end stores, and the rest.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import re


def kind(op: str, writer: str) -> str:
    """The kind of an instruction of opcode ``op`` (``writer``: the opcode that last set the
    predicate it is guarded by). A branch on an mbarrier try-wait's predicate waits for it, so it
    counts as the wait."""
    if op.startswith("SYNCS.PHASECHK") or op == "NANOSLEEP" or (op == "BRA" and writer.startswith("SYNCS.PHASECHK")):
        return "mbarrier wait"
    if op.startswith("BAR"):
        return "CTA barrier"
    if op.startswith("WARPGROUP.DEPBAR"):
        return "MMA wait"
    if op.startswith(("HGMMA", "QGMMA", "WARPGROUP.ARRIVE")):
        return "MMA issue"
    if op.startswith(("LDS", "LDG", "LDSM")):
        return "word and operand loads"
    if op.startswith(("STG", "STS", "STSM", "RED", "ATOM")):
        return "stores"
    if op.startswith(("UTMALDG", "SYNCS", "MEMBAR", "FENCE", "UBLKCP", "UTMA")):
        return "TMA copies and fences"
    if op.startswith("U") or op.startswith(("R2UR", "VOTEU", "ELECT", "S2UR")):
        return "uniform datapath"
    if op.startswith(("IMAD", "LOP3", "SHF", "PRMT", "HADD2", "HMUL2", "HFMA2", "F2FP", "IADD3", "SGXT", "LEA",
                      "ISETP", "SEL", "MOV", "FADD", "FMUL", "FFMA", "I2F", "F2I", "PLOP3", "BMSK", "IABS", "FSEL")):
        return "per-thread arithmetic (codec, addresses, predicates)"
    if op.startswith(("BRA", "BSYNC", "BSSY", "EXIT", "RET", "CALL", "WARPSYNC", "NOP", "YIELD")):
        return "control"
    return "other"


def load(path: str) -> tuple[list[str], list[dict[str, float]], list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    hdr, data = rows[start], [r for r in rows[start + 1:] if len(r) == len(rows[start])]
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    src = hdr.index("Source")
    samples = hdr.index("Warp Stall Sampling (All Samples)")
    ins = [r[src].strip() for r in data]
    vals = [{"samples": float(r[samples] or 0), **{h[6:]: float(r[hdr.index(h)] or 0) for h in reasons}} for r in data]
    return ins, vals, [h[6:] for h in reasons]


def opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] if ins else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    ins, vals, reasons = load(args.csv)
    total = sum(v["samples"] for v in vals)
    print(f"{args.csv}: {len(ins)} instructions, {total:.0f} samples")
    by: dict[str, dict[str, float]] = {}
    writers: dict[str, str] = {}  # predicate register -> the opcode that last wrote it (listing order)
    for i, v in zip(ins, vals):
        guard = re.match(r"^@!?(P\d)\s", i)
        k = kind(opcode(i), writers.get(guard.group(1), "") if guard else "")
        dest = re.match(r"^(?:@!?U?P\w+\s+)?\S+\s+(P\d)\s*,", i)
        if dest:
            writers[dest.group(1)] = opcode(i)
        acc = by.setdefault(k, {"samples": 0.0, "count": 0.0, **{r: 0.0 for r in reasons}})
        acc["count"] += 1
        for key, x in v.items():
            acc[key] += x
    print(f"\n| kind | instructions | samples | share | leading stall reasons (share of the kind's samples) |")
    print("|---|---|---|---|---|")
    for k, acc in sorted(by.items(), key=lambda kv: -kv[1]["samples"]):
        if not acc["samples"]:
            continue
        lead = sorted(((acc[r] / acc["samples"], r) for r in reasons), reverse=True)[:4]
        print(f"| {k} | {acc['count']:.0f} | {acc['samples']:.0f} | {acc['samples'] / total:.1%} | "
              + ", ".join(f"{r} {s:.0%}" for s, r in lead if s >= 0.02) + " |")
    print(f"\nTop {args.top} instructions by samples:")
    order = sorted(range(len(ins)), key=lambda j: -vals[j]["samples"])[:args.top]
    for j in order:
        v = vals[j]
        lead = sorted(((v[r] / v["samples"], r) for r in reasons if v["samples"]), reverse=True)[:3]
        print(f"  #{j:5d} {v['samples'] / total:6.1%}  {ins[j][:70]:70s} "
              + ", ".join(f"{r} {s:.0%}" for s, r in lead if s >= 0.05))


if __name__ == "__main__":
    main()
