"""Offline census of decode_loop.cu and of benchmarks/probe_cuda_loop.cu, the kernel built from it
and timed on the H200 (no GPU here): compile each for sm_90a with nvcc, disassemble it with the
cuobjdump Triton bundles, and count the consumer's instructions for one k-block in steady state:
ring stage 0's part of the unrolled loop (from its mbarrier wait to the next stage's), less the
tile-end store (the block the branch after the MMAs' wait skips); beside them the same count of
the Gluon kernel's rule build at 8 tokens, K = 2 (``bench_decode.steady_loop``).

    python benchmarks/results/cuda_loop_offline/census.py > benchmarks/results/cuda_loop_offline/census.txt
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(BENCHMARKS), BENCHMARKS]
from bench_decode import branches, cuobjdump, opcode_counts, sass_instructions, steady_loop  # noqa: E402


def gluon_rule_build() -> int:
    """Steady-state loop instructions of the Gluon kernel's rule build at 8 tokens (K = 2, the
    halves codec, one fragment, a ring of 3), compiled for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget

    import escha.kernels.decode_wgmma  # noqa: F401
    dw = sys.modules["escha.kernels.decode_wgmma"]  # the package exports a function of the same name
    _, frags, stages, halves = dw.rule_variant(8, 2)
    k = triton.compile(dw.gemm_source(2, 8, stages, frags, halves=halves), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "launch_pdl": True})
    return len(steady_loop(k.asm["sass"])[0])


def steady_kblock(source: str, defines: tuple[str, ...] = ()) -> tuple[str, list[str], int]:
    """(ptxas's register line, the consumer's instructions for one k-block in steady state, the
    stage's whole part of the loop) of a CUDA loop built for sm_90a: ring stage 0's part of the
    unrolled loop (from its wait on "full" to stage 1's), less the tile-end store (the block the
    branch after the MMAs' wait skips). The consumer's waits are the first three TRYWAITs."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "loop.cubin")
        build = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-cubin", "-Xptxas", "-v",
                                *defines, "-o", path, source], capture_output=True, text=True, check=True)
        with open(path, "rb") as f:
            cubin = f.read()
    usage = "\n".join(line for line in build.stderr.splitlines() if "registers" in line or "stack" in line)
    instrs, labels = sass_instructions(cuobjdump(cubin, "-sass"))
    waits = [i for i, t in enumerate(instrs) if "TRYWAIT" in t][:3]
    start, end = waits[0], waits[1]
    depbar = next(i for i in range(start, end) if instrs[i].startswith("WARPGROUP.DEPBAR"))
    s0, s1 = next((i, t) for i, t in branches(instrs, labels, addresses=True) if depbar < i < end and t > i)
    return usage, instrs[start:s0 + 1] + instrs[s1:end], end - start


def main() -> int:
    print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    for label, source, defines in (("decode_loop.cu (the prototype)", os.path.join(HERE, "decode_loop.cu"), ()),
                                   ("benchmarks/probe_cuda_loop.cu, MINB=4 (the one timed)",
                                    os.path.join(BENCHMARKS, "probe_cuda_loop.cu"), ("-DMINB=4",))):
        usage, steady, whole = steady_kblock(source, defines)
        ops = sorted(opcode_counts(steady).items(), key=lambda kv: -kv[1])
        print(f"{label}:\n{usage}")
        print(f"consumer, one k-block in steady state: {len(steady)} instructions "
              f"(the stage's part of the loop {whole}, tile-end store {whole - len(steady)})")
        print(", ".join(f"{op} {n}" for op, n in ops))
    print(f"the Gluon kernel's rule build at 8 tokens, counted the same way: {gluon_rule_build()} "
          "instructions a k-block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
