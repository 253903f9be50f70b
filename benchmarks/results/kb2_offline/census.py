"""Offline census (no GPU) of the two-k-blocks-a-stage candidate: the steady-state loop of the
register-operand decode GEMM a k-block (the tile-end store left out), for builds given as
BITS,TOKENS,STAGES,FRAGMENTS,HALVES,KBLOCKS_PER_STAGE. Run on a checkout with candidate.patch
applied:

    git apply benchmarks/results/kb2_offline/candidate.patch
    env -u TRITON_INTERPRET python benchmarks/results/kb2_offline/census.py 2,8,3,1,1,1 2,8,2,1,1,2 \\
        2,16,3,2,0,1 2,16,2,2,0,2 3,8,3,1,1,1 3,8,2,1,1,2 > benchmarks/results/kb2_offline/census.txt
"""
import os
import sys

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from bench_decode import programs_per_sm, res_usage, steady_loop  # noqa: E402

import escha.kernels.decode_wgmma  # noqa: E402,F401

dw = sys.modules["escha.kernels.decode_wgmma"]  # the package exports a function of the same name


def main() -> int:
    for spec in sys.argv[1:]:
        bits, bn, stages, frags, halves, kb = (int(v) for v in spec.split(","))
        extra = {"kblocks_per_stage": kb} if kb != 1 else {}
        k = triton.compile(dw.gemm_source(bits, bn, stages, frags, halves=bool(halves), **extra),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
        regs = res_usage(k.asm["cubin"])["REG"]
        steady, store = steady_loop(k.asm["sass"])
        print(f"{spec} registers {regs} shared {k.metadata.shared} programs an SM "
              f"{programs_per_sm(regs, k.metadata.shared)} loop {len(steady) + store} store block {store} "
              f"steady {len(steady)} per k-block {len(steady) / kb}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
