"""Offline facts of the bf16 pairs in the 64- and 128-token builds only (sm_90a, no GPU): each fp8
GEMM build of this tree against the tree before (.prev/decode_fp8_base.py) and the all-builds
candidate timed in ../fp8_bf16_pairs (.prev/decode_fp8_cand.py), by their SASS with the
addresses taken out; and the output transform's build for fp32 partials against the tree
before's (the kernel the 256-token build's partials go through). Counts and digests, not timings.
Usage (repository root), after
    benchmarks/snapshot_kernels.sh base REV          # REV: the tree before
    git worktree add /tmp/cand REV && (cd /tmp/cand && git apply \\
      benchmarks/results/fp8_bf16_pairs/candidate.patch && benchmarks/snapshot_kernels.sh cand) \\
      && cp /tmp/cand/.prev/*_cand.py .prev/
python benchmarks/results/fp8_pairs_blocks/offline.py > benchmarks/results/fp8_pairs_blocks/offline.txt"""
import hashlib
import importlib
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget

from escha.format import random_qweight
from escha.kernels.compile_check import cuobjdump, res_usage
from escha.kernels.triton_compat import compile_only

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_decode import load_previous  # noqa: E402

ADDRESS = re.compile(r"/\*[0-9a-f]{4}\*/")


def sass_body(cubin: bytes) -> list[str]:
    """The SASS instructions, without their addresses and encodings."""
    return [ADDRESS.sub("", line).split(";")[0].strip()
            for line in cuobjdump(cubin, "-sass").splitlines() if ADDRESS.search(line)]


def describe(cubin: bytes) -> str:
    body = sass_body(cubin)
    use = res_usage(cubin)
    digest = hashlib.sha1("\n".join(body).encode()).hexdigest()[:12]
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in body]  # predicate off
    stores = {op: ops.count(op) for op in sorted(set(ops)) if op.startswith("STG")}
    return f"regs {use['REG']}, stack {use['STACK']}, {len(body)} instructions, {stores}, sass {digest}"


tree = importlib.import_module("escha.kernels.decode_fp8")
arms = [("tree", tree), ("base", load_previous(".prev/decode_fp8_base.py"))]
if os.path.exists(".prev/decode_fp8_cand.py"):
    arms.append(("all-pairs", load_previous(".prev/decode_fp8_cand.py")))
target = GPUTarget("cuda", 90, 32)
print(f"triton {triton.__version__}, sm_90a")
print("fp8 GEMM builds (the rule's; partials: the tree's bf16 pairs at 64 and 128 tokens, fp32 at 256)")
for bn in sorted(tree.BUILDS):
    for bits in (2, 3):
        lines = {}
        for label, mod in arms:
            k = triton.compile(mod.gemm_source(bits, bn), target=target, options=mod.compile_options(bn))
            lines[label] = describe(k.asm["cubin"])
        for label, line in lines.items():
            same = [o for o in lines if o != label and lines[o] == line]
            print(f"  K={bits} {bn:3d} tokens {label:9s}: {line}" + (f"  (= {', '.join(same)})" if same else ""))

print("output transform, fp32 partials [4, M, Np] of gate_up (17408 x 5120), bf16 y, with PDL")
qw = random_qweight(17408, 5120, bits=2, seed=0)
np_ = qw.padded_shape[0]
base_t = sys.modules["escha.kernels._transforms_base"]
for label, mod in (("tree", importlib.import_module("escha.kernels.transforms")), ("base", base_t)):
    with compile_only(90) as compiled:
        for m in (136, 256):
            mod.hadamard_output(torch.zeros(4, m, np_), qw, torch.ones(m), torch.empty(m, 17408, dtype=torch.bfloat16),
                                dependent_launch=True, segments=torch.full((np_ // 64,), 4, dtype=torch.int32))
    for (name, k), m in zip(compiled, (136, 256)):
        print(f"  {label:4s} M={m}: {describe(k.asm['cubin'])}")
