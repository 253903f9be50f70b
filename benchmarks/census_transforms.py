"""Offline SASS census of the decode call's two transform kernels (no GPU needed).

    python benchmarks/census_transforms.py [--tree DIR] [--label NAME] [--prefill] --out FILE.json

Compiles, for sm_90a inside ``triton_compat.compile_only``, the input transform
(``hadamard_input(..., mma_order=True)``, bf16 x) and the output transform (``hadamard_output``,
the partials of the decode GEMM's rule, bf16 y) exactly as ``decode_wgmma`` launches them, at the seed
shapes and M = 1, 16, 64 (with ``--prefill``: the prefill paths' activation pass, ``actquant``, e4m3
and bf16, at the rule's launch shape), from the escha tree ``--tree`` (default: this checkout; another tree
gives the census of another version, e.g. an older commit's ``git archive``). Per kernel: the
warps, registers and local memory (``cuobjdump -res-usage``), the dynamic shared memory Triton
allocates, and the
whole program's SASS instruction count with the opcodes that say where its time goes (shared
memory stores and loads, barriers, shuffles, tensor-core and fp32 ops). Counts, not timings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from bench_decode import compile_in_child, opcode_counts, res_usage, sass_instructions  # noqa: E402

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704), "down_8b": (4096, 14336)}
WATCH = ("STS", "LDS", "BAR", "SHFL", "HMMA", "HGMMA", "FADD", "FFMA", "FMUL", "LDG", "STG")

# Run in a child process with the tree first on the path and no interpreter.
_COMPILE = r"""
import json, sys, torch
from escha.format import QuantizedWeight
from escha.kernels.triton_compat import compile_only
from escha.kernels.transforms import hadamard_input, hadamard_output
from escha.kernels.decode_wgmma import decode_wgmma_config, segment_counts
from escha.norm import RowNorm
shapes, ms, norm = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
prefill = json.loads(sys.argv[4])
out = []
for name, (n, k) in shapes.items():
    qw = QuantizedWeight.placeholder((n, k), 2)
    rn = RowNorm(torch.ones(k, dtype=torch.bfloat16), 1e-5) if norm else None
    for m in ms:
        x = torch.zeros(m, k, dtype=torch.bfloat16)
        if prefill:  # the prefill paths' activation pass, fp8 and bf16, at the rule's launch shape
            from escha.kernels.actquant import actquant
            for fp8 in (True, False):
                with compile_only() as compiled:
                    actquant(x, qw, fp8=fp8)
                for kname, kern in compiled:
                    out.append({"shape": name, "M": m, "kernel": kname + (":fp8" if fp8 else ":bf16"),
                                "num_warps": kern.metadata.num_warps, "shared": kern.metadata.shared,
                                "sass": kern.asm["sass"], "cubin": kern.asm["cubin"].hex()})
            continue
        cfg = decode_wgmma_config(qw, m, torch.device("cuda"))
        tiles = qw.padded_shape[0] // (64 * cfg.fragments)
        split = int(segment_counts(cfg.programs, tiles, qw.padded_shape[1] // 128, cfg.fragments).max())
        z = torch.zeros(split, m, qw.padded_shape[0])
        with compile_only() as compiled:
            hadamard_input(x, qw, mma_order=True, dependent_launch=True, release_early=True, norm=rn)
            inv = torch.ones(m)
            hadamard_output(z, qw, inv, torch.zeros(m, n, dtype=torch.bfloat16), dependent_launch=True)
        for kname, kern in compiled:
            out.append({"shape": name, "M": m, "kernel": kname + ("+norm" if norm and kname.startswith("_input") else ""),
                        "num_warps": kern.metadata.num_warps,
                        "shared": kern.metadata.shared, "sass": kern.asm["sass"], "cubin": kern.asm["cubin"].hex()})
json.dump(out, sys.stdout)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", default=ROOT, help="the escha tree to compile (default: this checkout)")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--ms", default="1,16,64")
    ap.add_argument("--shapes", default="gate_up,down", help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--norm", action="store_true", help="the input transform with the RMSNorm fused (norm=RowNorm)")
    ap.add_argument("--prefill", action="store_true",
                    help="the prefill paths' activation pass (actquant, e4m3 and bf16) instead of the decode transforms")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    compiled = compile_in_child(_COMPILE, args.tree, (json.dumps({s: SHAPES[s] for s in args.shapes.split(",")}),
                                                      json.dumps(ms), json.dumps(args.norm), json.dumps(args.prefill)),
                                timeout=1800)
    rows = []
    for e in compiled:
        counts = opcode_counts(sass_instructions(e["sass"])[0])
        counts.pop("NOP", None)
        rows.append({"shape": e["shape"], "M": e["M"], "kernel": e["kernel"], "num_warps": e["num_warps"],
                     "dynamic_shared": e["shared"], **res_usage(bytes.fromhex(e["cubin"])), "sass_instructions": sum(counts.values()),
                     **{op: counts.get(op, 0) for op in WATCH}})
    with open(args.out, "w") as f:
        json.dump({"tree": args.label, "target": "sm_90a", "rows": rows}, f, indent=1)
    cols = ["shape", "M", "kernel", "num_warps", "REG", "dynamic_shared", "LOCAL", "sass_instructions", *WATCH]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
