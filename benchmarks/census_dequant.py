"""SASS census of the dequantize-once kernels and their share of the integer floor.

    python benchmarks/census_dequant.py [--prefill benchmarks/results/prefill_h200_v6.json]
                                        [--out benchmarks/results/dequant_census]

Compiles, on any machine (no GPU: ``triton.compile`` for sm_90a), the two kernels that fill a
dequantize-once scratch at their rules' configurations, K = 2, e4m3 output, the PTX codec:
``dequant._dequant_kernel`` (the plain core, ``dequant-core-fp8``; one [128, 128] block a program,
no loop) and ``dequant_once.dequant_hn_kernel`` (the core with Hn folded in, ``dequant-fp8``; its
loop over [128, 64] blocks). It counts the SASS instructions of a program (the plain kernel) or
of one loop step (the folded one) by opcode, converts them to instructions and integer
operations per weight (a warp instruction serves 32 lanes), and sets the integer floor
(weights x integer ops per weight / (64 a clock per SM x 132 SMs x 1.98 GHz), as
``census_share.py`` does) against the H200 times of the kernels' ``part-`` arms in a committed
bench_prefill run (median over its M): how far each kernel is above its floor. Beside it the
memory floor: the bytes a kernel must move (the trellis words read, one e4m3 byte a weight
written) at the device-to-device copy rate (read + write) that ``escha bench`` measured on the
same GPU (``copy_bw_bytes_per_s`` of a committed results.json); the larger of the two floors
binds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from bench_decode import INT_OPS, compile_in_child, loop_census, opcode_counts, sass_instructions  # noqa: E402

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704)}
SMS, INT_PER_CLOCK, CLOCK_HZ = 132, 64, 1.98e9

# Compiled in a child process without the interpreter (the tests' conftest may have set it).
_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from escha.kernels.dequant import _dequant_kernel, dequant_config
from escha.kernels.dequant_once import dequant_hn_kernel, dequant_once_config
from escha.format import QuantizedWeight
qw = QuantizedWeight.placeholder((17408, 5120), 2, device="meta")
import torch
dc, oc = dequant_config(qw, torch.device("cpu")), dequant_once_config(qw, 1, torch.device("cpu"))
out = {}
src = ASTSource(_dequant_kernel, {"tr_ptr": "*i32", "out_ptr": "*fp8e4nv", "KT": "i32", "stride_on": "i32",
                                  "SCALE": "constexpr", "BITS": "constexpr", "BN": "constexpr", "BKT": "constexpr",
                                  "USE_PTX": "constexpr"},
                constexprs={"SCALE": 64.0, "BITS": 2, "BN": dc.block_n, "BKT": dc.block_kt, "USE_PTX": True},
                attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]],
                       (2,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": dc.num_warps})
out["plain"] = {"sass": k.asm["sass"], "num_warps": dc.num_warps, "weights": dc.block_n * 16 * dc.block_kt,
                "loop": False, "config": [dc.block_n, dc.block_kt, dc.num_warps]}
sig = {"tr_ptr": "*i32", "su_ptr": "*i8", "scale_ptr": "*fp16", "gscale_ptr": "*fp32", "h_ptr": "*fp16",
       "w_ptr": "*fp8e4nv", "wscale_ptr": "*fp32", "stride_w": "i32", "Np": "i32", "KT": "constexpr",
       "BITS": "constexpr", "BK": "constexpr", "K_PER_PROG": "constexpr", "OUT_FP8": "constexpr",
       "DOT_DTYPE": "constexpr", "USE_PTX": "constexpr"}
src = ASTSource(dequant_hn_kernel, sig,
                constexprs={"KT": 5120 // 16, "BITS": 2, "BK": oc.block_k, "K_PER_PROG": oc.k_per_prog,
                            "OUT_FP8": True, "DOT_DTYPE": triton.language.float16, "USE_PTX": True},
                attrs={(i,): [["tt.divisibility", 16]] for i in range(9)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": oc.num_warps, "num_stages": oc.num_stages})
out["folded"] = {"sass": k.asm["sass"], "num_warps": oc.num_warps, "weights": 128 * oc.block_k, "loop": True,
                 "config": [oc.block_k, oc.k_per_prog, oc.num_warps, oc.num_stages]}
json.dump(out, sys.stdout)
"""


def compile_sass() -> dict:
    return compile_in_child(_COMPILE, ROOT)


def program_census(sass: str) -> dict[str, int]:
    """Opcode counts of a whole kernel (a straight-line program: no loop to pick out)."""
    return opcode_counts(sass_instructions(sass)[0])


def census(entry: dict) -> dict:
    counts = loop_census(entry["sass"]) if entry["loop"] else program_census(entry["sass"])
    lanes = 32 * entry["num_warps"]
    int_ops = sum(counts.get(k, 0) for k in INT_OPS)
    return {"config": entry["config"], "scope": "loop step" if entry["loop"] else "program",
            "weights": entry["weights"], "instructions": sum(counts.values()), "int_ops": int_ops,
            "instructions_per_weight": sum(counts.values()) * lanes / entry["weights"],
            "int_ops_per_weight": int_ops * lanes / entry["weights"],
            "counts": dict(sorted(counts.items(), key=lambda kv: -kv[1]))}


def moved_bytes(n: int, k: int, bits: int = 2) -> int:
    """Bytes a dequantize-once kernel moves for an [n, k] weight: its trellis words read (``bits``
    a weight) and its e4m3 core written (one byte a weight)."""
    return n * k * bits // 8 + n * k


def copy_rate(path: str) -> float:
    """The device-to-device copy rate (bytes read + written a second) an ``escha bench`` results
    file measured."""
    with open(path) as f:
        return float(json.load(f)["meta"]["copy_bw_bytes_per_s"])


def measured(path: str, plain_arm: str) -> dict[tuple[str, str], float]:
    """Median over M of each kernel's part arm's µs per shape, from a bench_prefill results file."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    arms = {"plain": plain_arm, "folded": "part-dequant-fp8"}
    out = {}
    for kernel, arm in arms.items():
        for shape in SHAPES:
            us = sorted(r["us"] for r in rows if r["arm"] == arm and r["shape"] == shape)
            if us:
                out[(kernel, shape)] = us[len(us) // 2]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", default=os.path.join(ROOT, "benchmarks", "results", "prefill_h200_v6.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dequant_census"))
    ap.add_argument("--plain-arm", default="part-dequant-core-fp8-bn128w4",
                    help="the arm that ran the plain kernel at today's rule (128 x 128, 4 warps): in "
                         "prefill_h200_v6 a variant arm; part-dequant-core-fp8 in runs after it")
    ap.add_argument("--copy-rate-from", default=os.path.join(ROOT, "benchmarks", "results", "sweep_h200_v4",
                                                             "sweep_gate_up", "results.json"),
                    help="an escha bench results.json whose meta has the GPU's copy rate (the memory floor's)")
    args = ap.parse_args(argv)
    rate = copy_rate(args.copy_rate_from)
    sass = compile_sass()
    kernels = {name: census(entry) for name, entry in sass.items()}
    times = measured(args.prefill, args.plain_arm)
    points = []
    for name, c in kernels.items():
        for shape, (n, k) in SHAPES.items():
            floor_us = n * k * c["int_ops_per_weight"] / (INT_PER_CLOCK * SMS * CLOCK_HZ) * 1e6
            memory_us = moved_bytes(n, k) / rate * 1e6
            us = times.get((name, shape))
            points.append({"kernel": name, "shape": shape, "floor_us": floor_us, "memory_floor_us": memory_us,
                           "measured_us": us, "ratio": None if us is None else us / floor_us,
                           "memory_ratio": None if us is None else us / memory_us})
    doc = {"prefill_results": os.path.relpath(args.prefill, ROOT), "sms": SMS, "int_per_clock": INT_PER_CLOCK,
           "clock_hz": CLOCK_HZ, "int_ops": list(INT_OPS), "copy_rate_from": os.path.relpath(args.copy_rate_from, ROOT),
           "copy_bytes_per_s": rate, "kernels": kernels, "points": points}
    lines = ["# Dequantize-once kernels: SASS census and the integer floor", "",
             f"sm_90a SASS (offline `triton.compile`), K = 2, e4m3 output, PTX codec, the rules' configurations; "
             f"times: median over M of `{args.plain_arm}` (plain) and `part-dequant-fp8` (folded) in "
             f"`{doc['prefill_results']}` (H200). Floor: "
             f"weights x integer ops a weight / ({INT_PER_CLOCK} a clock x {SMS} SMs x {CLOCK_HZ / 1e9:.2f} GHz). "
             f"Memory floor: trellis words read and e4m3 core written (K = 2: 1.25 bytes a weight) at the copy "
             f"rate {rate / 1e12:.2f} TB/s (read + write) of `{doc['copy_rate_from']}`.", "",
             "| kernel | scope | instructions / weight | integer ops / weight | top opcodes |", "|---|---|---|---|---|"]
    for name, c in kernels.items():
        top = ", ".join(f"{op} {v}" for op, v in list(c["counts"].items())[:6])
        lines.append(f"| {name} {c['config']} | {c['scope']} ({c['weights']} weights) | "
                     f"{c['instructions_per_weight']:.2f} | {c['int_ops_per_weight']:.2f} | {top} |")
    lines += ["", "| kernel | shape | integer floor (µs) | memory floor (µs) | measured (µs) | measured / integer "
              "floor | measured / memory floor |", "|---|---|---|---|---|---|---|"]
    for p in points:
        m = "–" if p["measured_us"] is None else f"{p['measured_us']:.1f}"
        r = "–" if p["ratio"] is None else f"{p['ratio']:.2f}x"
        rm = "–" if p["memory_ratio"] is None else f"{p['memory_ratio']:.2f}x"
        lines.append(f"| {p['kernel']} | {p['shape']} | {p['floor_us']:.1f} | {p['memory_floor_us']:.1f} | {m} | {r} "
                     f"| {rm} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
