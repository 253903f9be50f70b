"""The fp8 decode GEMM's 256-token build with one and with two k-blocks a step, compiled for
sm_90a here (no GPU; counts, not timings): registers, stack, shared memory, programs an SM, and
the step loop's census (the innermost loop around its QGMMA), per k-block.

    python benchmarks/results/fp8_kb2/offline.py > benchmarks/results/fp8_kb2/offline.txt

Run on the patched tree (candidate.patch): one k-block a step with a ring of 3 is the build
before the patch (the same SASS as its commit's, which the script's hash of it lets one check).
"""
import hashlib
import os
import sys

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import INT_OPS, loop_census  # noqa: E402

from escha.kernels.compile_check import cuobjdump, programs_per_sm, res_usage  # noqa: E402
from escha.kernels.decode_fp8 import gemm_source  # noqa: E402

FORMS = [("one k-block a step, ring of 3 (before)", (3, 8, 2), 1), ("two k-blocks a step, ring of 2", (2, 8, 2), 2),
         ("one k-block a step, ring of 2 (the patch's build for a weight of one k-block)", (2, 8, 2), 1)]
print(f"triton {triton.__version__}, sm_90a, the 256-token build (8 x 2 warps, 128 rows, 16 warps a program)")
for bits in (2, 3):
    for label, build, kps in FORMS:
        k = triton.compile(gemm_source(bits, 256, build=build, kblocks_per_step=kps), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 16, "launch_pdl": True})
        sass = cuobjdump(k.asm["cubin"], "-sass")
        usage = res_usage(k.asm["cubin"])
        counts = loop_census(k.asm["sass"], containing="QGMMA")
        body = sum(counts.values())
        int_ops = sum(counts.get(op, 0) for op in INT_OPS)
        per = {op: counts.get(op, 0) / kps for op in ("BAR", "UTMALDG", "SYNCS", "QGMMA", "STSM", "LDG")}
        print(f"K={bits} {label}: {usage['REG']} registers, stack {usage['STACK']}, shared {k.metadata.shared} B, "
              f"{programs_per_sm(usage['REG'], k.metadata.shared, threads=512)} an SM; "
              f"cuobjdump -sass md5 {hashlib.md5(sass.encode()).hexdigest()[:8]}")
        print(f"    step loop {body} instructions for {kps} k-block(s): {body / kps:.1f} a k-block "
              f"({body / kps / 32:.2f} a weight, 32 weights a thread and k-block), integer ops {int_ops / kps / 32:.2f} a "
              f"weight; a k-block: " + ", ".join(f"{op} {v:g}" for op, v in per.items()))
