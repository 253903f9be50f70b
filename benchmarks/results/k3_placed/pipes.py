"""The decode loops' integer and fp16 work a step by pipe, offline (sm_90a SASS, no GPU).

    python benchmarks/results/k3_placed/pipes.py > OUT.txt

For each build the rule launches (the register-operand GEMM at 8, 16 and 64 tokens, M a multiple
of 16 from 16 tokens; the fp8 GEMM's 128 and 256-token builds), K = 2 and 3: the step loop's
instructions (``bench_decode.steady_loop``: without the tile-end store; the fp8 GEMM's innermost
loop around its QGMMA) on the FMA-heavy pipe (IMAD of every kind, and HADD2 / HMUL2, which GH100
issues to both FMA pipes) and on the ALU pipe (the other integer, logic, shift and permute ops,
SGXT among them). Pipe classes: NVIDIA's description of GH100's math pipes (developer forums,
"Separate CUDA core pipeline for FP16 and FP32", 2024: IMAD on FMA-heavy, FP16x2 dual-issued to
FMA-heavy and FMA-lite; the ALU pipe executes INT32 except IMAD, logic, binary and data movement).
F2FP (the e4m3 conversion) is listed apart: its pipe is not documented there. The cycles a
warp's step needs at least, on one scheduler: the larger of its instructions (one issue a cycle)
and twice its ALU or its FMA-heavy instructions (a 16-lane pipe takes a warp instruction in two
cycles); latencies, barriers and the other warps come on top.
"""
import os
import sys

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import loop_region, opcode_counts, sass_instructions, steady_loop  # noqa: E402

import escha.kernels.decode_fp8  # noqa: E402,F401  (the package re-exports the ops under the modules' names)
import escha.kernels.decode_wgmma  # noqa: E402,F401

dw = sys.modules["escha.kernels.decode_wgmma"]
d8 = sys.modules["escha.kernels.decode_fp8"]
FMA_HEAVY = ("IMAD", "HADD2", "HMUL2", "HFMA2")
ALU = ("LOP3", "SHF", "PRMT", "SGXT", "ISETP", "LEA", "SEL", "IADD3", "IMNMX", "PLOP3", "MOV", "SHL", "SHR", "VIADD")


def line(name: str, counts: dict) -> str:
    """One build's counts, and the cycles a warp's step needs at least on one scheduler: one issue
    a cycle, and two cycles of its pipe for each ALU or FMA-heavy instruction (16 lanes a pipe)."""
    fma = sum(counts.get(op, 0) for op in FMA_HEAVY)
    alu = sum(counts.get(op, 0) for op in ALU)
    total = sum(counts.values())
    bound = max((total, "issue"), (2 * alu, "ALU"), (2 * fma, "FMA-heavy"))
    top = ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1]) if n >= 16)
    return (f"{name}: {total} instructions a step; FMA-heavy {fma}, ALU {alu}, F2FP {counts.get('F2FP', 0)}; "
            f"at least {bound[0]} cycles ({bound[1]}; 2 x ALU {2 * alu}, 2 x FMA-heavy {2 * fma}) ({top})")


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    print(f"triton {triton.__version__}, sm_90a")
    for bits in (2, 3):
        for bn in (8, 16, 64):
            _, frags, stages, halves = dw.rule_variant(bn, bits)
            cap = dw.register_cap(bits, bn)
            mult = ("M", "Np") if bn >= 16 else ("Np",)
            k = triton.compile(dw.gemm_source(bits, bn, stages, frags, halves=halves, multiples_of_16=mult),
                               target=target, options={"num_warps": 4, "launch_pdl": True,
                                                       **({"maxnreg": cap} if cap else {})})
            loop, _ = steady_loop(k.asm["sass"])
            print(line(f"decode_wgmma K={bits} {bn} tokens (64 weights a thread)", opcode_counts(loop)))
        for bn in (128, 256):
            k = triton.compile(d8.gemm_source(bits, bn), target=target, options=d8.compile_options(bn))
            instrs, _, first, last = loop_region(k.asm["sass"], "QGMMA")
            weights = 64 // d8.BUILDS[bn][2]
            print(line(f"decode_fp8 K={bits} {bn} tokens ({weights} weights a thread)",
                       opcode_counts(instrs[first:last + 1])))


if __name__ == "__main__":
    main()
