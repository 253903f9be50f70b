"""Offline sm_90a builds of the fp8 decode GEMM's 128-token block beside the rule's (no GPU).

    python benchmarks/results/fp8_builds/builds.py > benchmarks/results/fp8_builds/builds.txt

For each (K, stages, warps_m, warps_n, register cap): registers, stack (spills), shared memory and
the programs an SM they allow (``compile_check.programs_per_sm`` over the build's threads), and
the SASS instructions of the whole kernel. What ``bench_decode_fp8.py --build-variants`` times.
"""
import sys

import triton
from triton.backends.compiler import GPUTarget

import escha.kernels.decode_fp8  # noqa: F401  (the package re-exports the op under the module's name)
from escha.kernels.compile_check import cuobjdump, programs_per_sm, res_usage

d = sys.modules["escha.kernels.decode_fp8"]


def build(bits: int, bn: int, stages: int, wm: int, wn: int, cap: int | None) -> str:
    src = d.gemm_source(bits, bn, build=(stages, wm, wn))
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": wm * wn, "launch_pdl": True, **({"maxnreg": cap} if cap else {})})
    r = res_usage(k.asm["cubin"])
    sass = sum(1 for line in cuobjdump(k.asm["cubin"], "-sass").splitlines() if line.strip().startswith("/*") and ";" in line)
    per_sm = programs_per_sm(r["REG"], k.metadata.shared, 32 * wm * wn)
    return (f"K={bits} BN={bn} stages={stages} warps {wm}x{wn} cap={cap}: {r['REG']} registers, stack "
            f"{r['STACK']}, shared {k.metadata.shared} B, {per_sm} programs an SM ({per_sm * wm * wn} warps), "
            f"{sass} SASS instructions")


if __name__ == "__main__":
    print(f"triton {triton.__version__}, sm_90a")
    for bits in (2, 3):
        for args in [(128, 2, 4, 1, 168), (128, 2, 8, 1, None), (128, 2, 8, 1, 128), (128, 3, 8, 1, 128),
                     (256, 3, 8, 2, None)]:
            print(build(bits, *args), flush=True)
