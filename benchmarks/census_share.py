"""Share of the integer floor, per decode point: the register-operand decode GEMM's loop census
(sm_90a SASS, compiled here without a GPU) set against its measured time in the dense sweep.

For each point, the GEMM build its launch compiles (the point's configuration: token block,
fragments, stages, codec, register cap; the integer arguments Triton specializes as a launch of
this tree does, M as ``decode_wgmma.partial_rows`` rounds it) is counted by opcode, as each step
runs it: the loop (``bench_decode.steady_loop``) every step, and the tile-end store inside it (the
branch that skips it) once per part of a row tile a program holds (``decode_wgmma.segment_counts``:
about 800 parts for 10880 steps on gate_up). Its integer operations (bench_decode.INT_OPS: IMAD,
LOP3, PRMT, SHF, ...) per weight give a floor of

    floor = int ops per weight x N x K / (64 per clock per SM x SMs x clock)

(64: the integer lanes of an SM sub-partition group per clock, as docs/KERNELS.md's census uses),
and the share is floor / the whole call's median time (input transform, GEMM, output transform)
from the sweep's escha-decode-wgmma arm. The floor counts each weight decoded once: past one token
block (more than 128 tokens) the kernel decodes it once per block, which the table shows. (Until
this form the census counted the loop's whole body per step, the tile-end store with it: 5.1-6.4
integer ops a weight at 16-64 tokens where a step runs 4.2-4.3, so the shares it gave were high.)

    python benchmarks/census_share.py [--sweep benchmarks/results/sweep_h200] \\
        [--out benchmarks/results/decode_wgmma_census_share]
    python benchmarks/census_share.py --bench benchmarks/results/transforms_h200/decode_df4e2ec.json \\
        --out benchmarks/results/transforms_h200/census_share_df4e2ec
    python benchmarks/census_share.py --kernel decode-fp8 \\
        --bench benchmarks/results/decode_fp8/h200_ad4f7ce/bench_fp8/decode_fp8.json \\
        --out benchmarks/results/decode_fp8/h200_ad4f7ce/census_share

``--kernel decode-fp8``: the fp8 decode GEMM's builds (``decode_fp8.BUILDS``, token blocks 64-256),
its step loop (the innermost loop around its QGMMA: a row tile's store closes an outer one, so
the step loop holds no store), a thread's 64 / warps_n weights a step, and the times of a
``bench_decode_fp8.py`` result's "fp8" arm (its rule's whole call) at every M.

``--bench`` takes the times from a ``bench_decode_wgmma.py`` result instead of a sweep (its
"wgmma" arm: the rule's whole call, at the configuration the result records; any of its shapes;
the clock is the GPU's maximum). ``--ms`` keeps only the points whose kernel this tree builds (a
result measured before a change to the kernel).

The floor's 64 lanes are one 16-lane pipe per sub-partition. The loop's integer work is split
about evenly between the ALU pipe (LOP3, PRMT, SHF) and the FMA pipe (IMAD), which run side by
side, so the issue-bound time is about half this floor: ncu's issue-slot use is the direct
measure (docs/KERNELS.md, "Counters, halves, stall reasons").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import (INT_OPS, compile_in_child, loop_census, opcode_counts, sass_instructions,  # noqa: E402
                          steady_loop_span)

from escha.bench.report import git_sha  # noqa: E402
from escha.format.spec import padded  # noqa: E402
from escha.kernels.decode_fp8 import BUILDS, rule_block  # noqa: E402
from escha.kernels.decode_wgmma import (BLOCK_K, HOPPER_SMS, config_with_programs, partial_rows,  # noqa: E402
                                        segment_counts, tiles_and_steps)

# Gluon is compiled in a child process, away from any interpreter state (tests/test_decode_wgmma.py).
# BUILDS: the JSON keys of ``launch_build``.
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.decode_wgmma import gemm_source
out = {}
for key in BUILDS:
    bits, bn, frags, stages, halves, cap, mult, one = json.loads(key)
    k = triton.compile(gemm_source(bits, bn, stages, frags, halves=halves, multiples_of_16=tuple(mult), one_token=one),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})})
    out[key] = k.asm["sass"]
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


def _short(rev: str) -> str:
    """A commit's short form; a label of a patched tree (``sha+patch``) whole."""
    return rev if "+" in rev else rev[:7]


def launch_build(bits: int, n: int, k: int, m: int, cfg: dict) -> str:
    """The GEMM build a launch at m tokens on an N x K weight compiles with configuration ``cfg``
    (``DecodeWgmmaConfig`` as a dict), as a JSON key: (K, token block, fragments, stages, halves,
    register cap, the integer arguments Triton specializes as multiples of 16, M the constant 1).
    Triton marks an integer argument divisible by 16 when its value is, and makes a value of 1 a
    constant; M is ``partial_rows``' (this tree's launch)."""
    np_, kp = padded(n), padded(k)
    bn, frags = cfg["block_tokens"], cfg["fragments"]
    steps = tiles_and_steps((np_, kp), frags)[1]
    mk = partial_rows(m, bn)
    values = {"M": mk, "Np": np_, "NKB": kp // BLOCK_K, "STEPS": steps, "PROGRAMS": min(cfg["programs"], steps)}
    mult = [name for name, v in values.items() if v % 16 == 0]
    return json.dumps([bits, bn, frags, cfg["stages"], cfg["halves"], cfg["max_registers"], mult, mk == 1])


def steps_and_parts(n: int, k: int, cfg: dict) -> tuple[int, int]:
    """A token block's steps (row tiles x k-blocks) and its parts of row tiles (each program's run
    of steps within one tile): the loop runs once a step, the tile-end store once a part."""
    np_, kp = padded(n), padded(k)
    tiles, steps = tiles_and_steps((np_, kp), cfg["fragments"])
    parts = int(segment_counts(min(cfg["programs"], steps), tiles, kp // BLOCK_K, 1).sum())
    return steps, parts


def step_census(sass: str, steps: int, parts: int, fragments: int) -> dict:
    """Opcode counts a step of the loop runs on average (``steady_loop_span``: the loop every
    step, the tile-end store it branches over ``parts / steps`` of the steps), and its integer
    operations per weight (64 weights a thread and fragment)."""
    instrs, _ = sass_instructions(sass)
    first, s0, s1, last = steady_loop_span(sass)
    steady = opcode_counts(instrs[first:s0 + 1] + instrs[s1:last + 1])
    store = opcode_counts(instrs[s0 + 1:s1])
    steady_int = sum(steady.get(op, 0) for op in INT_OPS)
    store_int = sum(store.get(op, 0) for op in INT_OPS)
    per_step = steady_int + store_int * parts / steps
    return {"steady_instructions": sum(steady.values()), "steady_int_ops": steady_int,
            "store_instructions": sum(store.values()), "store_int_ops": store_int,
            "parts_per_step": parts / steps, "int_ops_per_weight": per_step / (64 * fragments),
            "counts": steady, "store_counts": store}


def rule_config(bits: int, n: int, k: int, m: int, sms: int) -> dict:
    """The configuration this tree's rule gives a point on an N x K weight (a sweep's rows record
    none), for an sm_90 device of HOPPER_SMS SMs (the rule's offline grid)."""
    if sms != HOPPER_SMS:
        raise SystemExit(f"the rule's offline grid assumes {HOPPER_SMS} SMs; the sweep ran on {sms}")
    shape = SimpleNamespace(padded_shape=(padded(n), padded(k)), bits=bits)  # all the rule reads of a weight
    return dataclasses.asdict(config_with_programs(shape, m, None))


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


def measured_points(args, arm: str = "wgmma", max_m: int = 256) -> tuple[list[tuple], dict]:
    """(shape, N, K, M, whole-call µs, bits, configuration) of every gated decode point up to 256
    tokens, and the run's GPU, SMs, clock and commit: from the dense sweep (K=2, no configuration
    recorded: None), or from a bench_decode_wgmma.py result (its points' bits, 2 where a result
    predates them, and the rule's configuration it ran, None where it records none)."""
    points = []
    if args.bench:
        with open(args.bench) as f:
            res = json.load(f)
        env = res["env"]
        meta = {"sms": env["sms"], "clock_hz": float(env["clocks_mhz"].split(",")[-1]) * 1e6,
                "git_sha": env["git"], "gpu": env["gpu"]}
        for p in res["points"]:
            if "us" in p and arm in p["us"] and p["M"] <= max_m:
                points.append((p["shape"], p["N"], p["K"], p["M"], p["us"][arm], p.get("bits", 2), p.get("config")))
        return points, meta
    for shape in ("gate_up", "down"):
        with open(os.path.join(args.sweep, f"{shape}_results.json")) as f:
            res = json.load(f)
        meta = res["meta"]
        for r in res["rows"]:
            if r["arm"] == args.arm and r["M"] <= 256 and r.get("gate") == "pass":
                points.append((shape, r["N"], r["K"], r["M"], r["us"], 2, None))
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
    points, meta = measured_points(args, "fp8", 1024) if fp8 else measured_points(args)
    if args.git:
        meta = {**meta, "git_sha": args.git}
    if args.ms:
        keep = {int(v) for v in args.ms.split(",")}
        points = [p for p in points if p[3] in keep]
    sms, clock = meta["sms"], meta["clock_hz"]
    census = fp8_census() if fp8 else {}
    configs = [None if fp8 else cfg or rule_config(bits, n, k, m, sms) for _, n, k, m, _, bits, cfg in points]
    if not fp8:  # each point's build, compiled once
        keys = sorted({launch_build(bits, n, k, m, cfg) for (_, n, k, m, _, bits, _), cfg in zip(points, configs)})
        sass = compile_in_child(_COMPILE.replace("BUILDS", repr(keys)), ROOT, what="the kernel")
    rows = []
    for (shape, n, k, m, us, bits, _), cfg in zip(points, configs):
        if fp8:
            block = rule_block(m)
            c = census[f"K{bits}/{block}"]
        else:
            block = cfg["block_tokens"]
            key = launch_build(bits, n, k, m, cfg)
            c = step_census(sass[key], *steps_and_parts(n, k, cfg), cfg["fragments"])
            census[f"{shape} M={m}"] = {"build": json.loads(key), **c}
        floor_us = c["int_ops_per_weight"] * n * k / (64 * sms * clock) * 1e6
        rows.append({"shape": shape, "bits": bits, "M": m, "token_block": block, "decodes": -(-m // block), "us": us,
                     "int_ops_per_weight": round(c["int_ops_per_weight"], 3), "floor_us": floor_us,
                     "share": floor_us / us})
    source = args.bench or args.sweep
    meta_out = {"sweep": os.path.relpath(source, ROOT), "sweep_git": meta["git_sha"], "census_git": git_sha(),
                "gpu": meta["gpu"], "clock_hz": clock, "sms": sms, "kernel": args.kernel,
                "arm": ("fp8" if fp8 else "wgmma") if args.bench else args.arm, "int_ops": list(INT_OPS)}
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta_out, "census": census, "rows": rows}, f, indent=1)
    title = "fp8 decode GEMM (decode_fp8)" if fp8 else "Register-operand decode"
    lines = [f"# {title}: share of the integer floor per point ({meta['gpu']}, measured at "
             f"{_short(meta['git_sha'])}, {meta_out['sweep']}; census of the tree at {_short(meta_out['census_git'])})", "",
             "floor = integer ops per weight (loop census, sm_90a SASS" + (")" if fp8 else ": the loop every step, "
             "the tile-end store once a part of a row tile)") + " x N x K / (64 x SMs x clock); share = "
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
