"""Share of the integer floor, per decode point: the register-operand decode GEMM's loop census
(sm_90a SASS, compiled here without a GPU) set against its measured time in the dense sweep.

For each token block of the rule (8..128 tokens; fragments, stages and codec as
``decode_wgmma.rule_variant`` picks them: one fragment, the halves codec at 8 tokens) the loop
body - the longest region closed by a backward branch - is counted by opcode; its integer
operations (bench_decode.INT_OPS: IMAD, LOP3, PRMT, SHF, ...) per weight give a floor of

    floor = int ops per weight x N x K / (64 per clock per SM x SMs x clock)

(64: the integer lanes of an SM sub-partition group per clock, as docs/KERNELS.md's census uses),
and the share is floor / the whole call's median time (input transform, GEMM, output transform)
from the sweep's escha-decode-wgmma arm. The floor counts each weight decoded once: past one token
block (more than 128 tokens) the kernel decodes it once per block, which the table shows.

    python benchmarks/census_share.py [--sweep benchmarks/results/sweep_h200] \\
        [--out benchmarks/results/decode_wgmma_census_share]
    python benchmarks/census_share.py --bench benchmarks/results/transforms_h200/decode_df4e2ec.json \\
        --out benchmarks/results/transforms_h200/census_share_df4e2ec
    python benchmarks/census_share.py --kernel decode-fp8 \\
        --bench benchmarks/results/decode_fp8/h200_ad4f7ce/bench_fp8/decode_fp8.json \\
        --out benchmarks/results/decode_fp8/h200_ad4f7ce/census_share

``--kernel decode-fp8``: the fp8 decode GEMM's builds (``decode_fp8.BUILDS``, token blocks 64-256),
its step loop (the innermost loop around its QGMMA: a row tile's store closes an outer one), a
thread's 64 / warps_n weights a step, and the times of a ``bench_decode_fp8.py`` result's "fp8"
arm (its rule's whole call) at every M.

``--bench`` takes the times from a ``bench_decode_wgmma.py`` result instead of a sweep (its
"wgmma" arm: the rule's whole call; any of its shapes; the clock is the GPU's maximum). ``--ms``
keeps only the points whose kernel this tree builds (a result measured before a rule change).

The floor's 64 lanes are one 16-lane pipe per sub-partition. The loop's integer work is split
about evenly between the ALU pipe (LOP3, PRMT, SHF) and the FMA pipe (IMAD), which run side by
side, so the issue-bound time is about half this floor: ncu's issue-slot use is the direct
measure (docs/KERNELS.md, "Counters, halves, stall reasons").
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import INT_OPS, compile_in_child, loop_census  # noqa: E402

from escha.kernels.decode_fp8 import BUILDS, rule_block  # noqa: E402
from escha.kernels.decode_wgmma import MAX_TOKENS, rule_variant  # noqa: E402

# (K, token block, fragments, stages, halves) of the rule's variants (the same for every weight shape).
VARIANTS = [(bits, *rule_variant(bn, bits)) for bits in (2, 3) for bn in (8, 16, 32, 64, 128) if bn <= MAX_TOKENS]

# Gluon is compiled in a child process, away from any interpreter state (tests/test_decode_wgmma.py).
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.decode_wgmma import gemm_source
out = {}
for bits, bn, frags, stages, halves in VARIANTS:
    k = triton.compile(gemm_source(bits, bn, stages, frags, halves=halves), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": True})
    out[f"{bits},{bn},{frags}"] = k.asm["sass"]  # the loop census needs no stage count
json.dump(out, sys.stdout)
"""


_COMPILE_FP8 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.decode_fp8 import BUILDS, compile_options, gemm_source
out = {}
for bits in (2, 3):
    for bn in sorted(BUILDS):
        k = triton.compile(gemm_source(bits, bn), target=GPUTarget("cuda", 90, 32), options=compile_options(bn))
        out[f"{bits},{bn}"] = k.asm["sass"]
json.dump(out, sys.stdout)
"""


def compile_sass() -> dict[tuple[int, int, int], str]:
    out = compile_in_child(_COMPILE.replace("VARIANTS", repr(VARIANTS)), ROOT, what="the kernel")
    return {tuple(int(v) for v in k.split(",")): s for k, s in out.items()}


def fp8_census() -> dict[str, dict]:
    """The fp8 decode GEMM's step-loop census per (K, token block): a thread decodes 64 / warps_n
    weights a step."""
    out = compile_in_child(_COMPILE_FP8, ROOT, what="decode_fp8")
    census = {}
    for key, text in out.items():
        bits, bn = (int(v) for v in key.split(","))
        counts = loop_census(text, containing="QGMMA")
        int_ops = sum(counts.get(k, 0) for k in INT_OPS)
        weights = 64 // BUILDS[bn][2]
        census[f"K{bits}/{bn}"] = {"warps": BUILDS[bn][1] * BUILDS[bn][2], "weights_per_thread": weights,
                                   "loop_instructions": sum(counts.values()), "int_ops": int_ops,
                                   "int_ops_per_weight": int_ops / weights, "counts": counts}
    return census


def token_block(m: int) -> int:
    """decode_wgmma_config's token block for m tokens."""
    return rule_variant(m, 2)[0]


def measured_points(args, arm: str = "wgmma", max_m: int = 256) -> tuple[list[tuple[str, int, int, int, float, int]], dict]:
    """(shape, N, K, M, whole-call µs, bits) of every gated decode point up to 256 tokens, and the
    run's GPU, SMs, clock and commit: from the dense sweep (K=2), or from a bench_decode_wgmma.py
    result (its points' bits, 2 where a result predates them)."""
    points = []
    if args.bench:
        with open(args.bench) as f:
            res = json.load(f)
        env = res["env"]
        meta = {"sms": env["sms"], "clock_hz": float(env["clocks_mhz"].split(",")[-1]) * 1e6,
                "git_sha": env["git"], "gpu": env["gpu"]}
        for p in res["points"]:
            if "us" in p and arm in p["us"] and p["M"] <= max_m:
                points.append((p["shape"], p["N"], p["K"], p["M"], p["us"][arm], p.get("bits", 2)))
        return points, meta
    for shape in ("gate_up", "down"):
        with open(os.path.join(args.sweep, f"{shape}_results.json")) as f:
            res = json.load(f)
        meta = res["meta"]
        for r in res["rows"]:
            if r["arm"] == args.arm and r["M"] <= 256 and r.get("gate") == "pass":
                points.append((shape, r["N"], r["K"], r["M"], r["us"], 2))
    return points, meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", default=os.path.join(ROOT, "benchmarks", "results", "sweep_h200"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "decode_wgmma_census_share"))
    ap.add_argument("--arm", default="escha-decode-wgmma")
    ap.add_argument("--bench", help="a bench_decode_wgmma.py result json to take the times from instead")
    ap.add_argument("--ms", help="only these M (comma-separated): the points whose kernel is this tree's")
    ap.add_argument("--kernel", choices=("decode-wgmma", "decode-fp8"), default="decode-wgmma")
    ap.add_argument("--git", help="the commit the timings measured, where the result's own field does not name it "
                                  "(a run started without ESCHA_GIT_SHA on a tree whose .git was stale)")
    args = ap.parse_args()
    fp8 = args.kernel == "decode-fp8"
    if fp8 and not args.bench:
        ap.error("--kernel decode-fp8 takes its times from a bench_decode_fp8.py result (--bench)")
    census = {}
    if fp8:
        census = fp8_census()
    else:
        for (bits, bn, frags), text in compile_sass().items():
            counts = loop_census(text)
            int_ops = sum(counts.get(k, 0) for k in INT_OPS)
            census[f"K{bits}/{bn}"] = {"fragments": frags, "loop_instructions": sum(counts.values()),
                                       "int_ops": int_ops, "int_ops_per_weight": int_ops / (64 * frags),
                                       "counts": counts}
    points, meta = measured_points(args, "fp8", 1024) if fp8 else measured_points(args)
    if args.git:
        meta = {**meta, "git_sha": args.git}
    if args.ms:
        keep = {int(v) for v in args.ms.split(",")}
        points = [p for p in points if p[3] in keep]
    sms, clock = meta["sms"], meta["clock_hz"]
    rows = []
    for shape, n, k, m, us, bits in points:
        block = rule_block(m) if fp8 else token_block(m)
        c = census[f"K{bits}/{block}"]
        floor_us = c["int_ops_per_weight"] * n * k / (64 * sms * clock) * 1e6
        rows.append({"shape": shape, "bits": bits, "M": m, "token_block": block, "decodes": -(-m // block), "us": us,
                     "int_ops_per_weight": round(c["int_ops_per_weight"], 3), "floor_us": floor_us,
                     "share": floor_us / us})
    source = args.bench or args.sweep
    meta_out = {"sweep": os.path.relpath(source, ROOT), "sweep_git": meta["git_sha"], "gpu": meta["gpu"],
                "clock_hz": clock, "sms": sms, "kernel": args.kernel,
                "arm": ("fp8" if fp8 else "wgmma") if args.bench else args.arm, "int_ops": list(INT_OPS)}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta_out, "census": census, "rows": rows}, f, indent=1)
    title = "fp8 decode GEMM (decode_fp8)" if fp8 else "Register-operand decode"
    lines = [f"# {title}: share of the integer floor per point ({meta['gpu']}, measured at "
             f"{meta['git_sha'][:7]}, {meta_out['sweep']})", "",
             "floor = integer ops per weight (loop census, sm_90a SASS) x N x K / (64 x SMs x clock); share = "
             f"floor / the whole call's median ({meta_out['arm']}: input transform, GEMM, output transform).", "",
             "| shape | K | M | token block | decodes a weight | int ops / weight | floor µs | measured µs | share |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['bits']} | {r['M']} | {r['token_block']} | {r['decodes']} | "
                     f"{r['int_ops_per_weight']:.2f} | {r['floor_us']:.1f} | {r['us']:.1f} | {100 * r['share']:.0f}% |")
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
