"""CTA barriers a step: the register-operand decode GEMM's loop against a warp-specialized ring,
both compiled for sm_90a here (no GPU; PTX, not timings).

1. For each variant of the rule (``decode_wgmma.rule_variant``), the loop of the GEMM from the
   bar.sync before its first mbarrier wait to the loop's end (the release of the dependent
   launch): its ``bar.sync`` (all 128 threads) and ``fence.proxy.async`` a step.
2. A probe of the structure that would replace it: a ring of 3 TMA stages filled by a loader
   partition of one warp (``gl.warp_specialize``, 24 registers) and read by a 4-warp default
   partition that waits on a "ready" mbarrier, reads the stage from shared memory, fences and
   arrives on an "empty" mbarrier: the consumer's barriers a step, and the loader's.

    python benchmarks/census_barriers.py [--out benchmarks/results/barriers_offline]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import compile_in_child  # noqa: E402

_COMPILE = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, fence_async_shared, tma
from triton.experimental.gluon._runtime import GluonASTSource
from escha.kernels.decode_wgmma import MAX_TOKENS, gemm_source, rule_variant

target = GPUTarget("cuda", 90, 32)
out = {"gemm": {}, "probe": {}}
for bits in (2, 3):
    for bn in (8, 16, 32, 64, 128):
        if bn > MAX_TOKENS:
            continue
        bt, frags, stages, halves = rule_variant(bn, bits)
        ptx = triton.compile(gemm_source(bits, bt, stages, frags, halves=halves), target=target,
                             options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]
        start = ptx.rfind("bar.sync", 0, ptx.index("mbarrier.try_wait.parity"))
        end = ptx.index("griddepcontrol.launch_dependents", start)
        loop = ptx[start:end]
        out["gemm"][f"K={bits} tokens={bt} fragments={frags} halves={halves}"] = {
            "bar.sync": loop.count("bar.sync"), "fence.proxy.async": loop.count("fence.proxy.async")}

S = gl.constexpr(3)


@gluon.jit
def loader(w_desc, bufs, ready, empty, n):
    for i in range(n):
        s = i % S
        mbarrier.wait(empty.index(s), ((i // S) & 1) ^ 1)
        mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [i * 8, 0], ready.index(s), bufs.index(s))


@gluon.jit
def consumer(bufs, ready, empty, out_ptr, n):
    L: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    acc = gl.zeros([8, 128], gl.int32, L)
    for i in range(n):
        s = i % S
        mbarrier.wait(ready.index(s), (i // S) & 1)
        acc += bufs.index(s).load(L)
        fence_async_shared()
        mbarrier.arrive(empty.index(s), count=1)
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, L))
    gl.store(out_ptr + r[:, None] * 128 + c[None, :], acc)


@gluon.jit
def ring(w_desc, out_ptr, n):
    bufs = gl.allocate_shared_memory(gl.int32, [S, 8, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(S):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([(consumer, (bufs, ready, empty, out_ptr, n)), (loader, (w_desc, bufs, ready, empty, n))],
                       [1], [24])


layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
sig = {"w_desc": f"tensordesc<i32[8, 128],{layout!r}>", "out_ptr": "*i32", "n": "i32"}
ptx = triton.compile(GluonASTSource(ring, sig, constexprs={}, attrs={}), target=target,
                     options={"num_warps": 4}).asm["ptx"]
# The consumer's loop holds the ld.shared of the stage; the loader's the bulk tensor copy.
blocks = re.split(r"\n\$L__BB\d+_\d+:", ptx)
for name, marker in (("consumer", "ld.shared.v4"), ("loader", "cp.async.bulk.tensor")):
    body = next(b for b in blocks if marker in b and "try_wait" in b)
    out["probe"][name] = {k: body.count(k) for k in ("bar.sync", "barrier.sync", "bar.warp.sync", "fence.proxy.async")}
json.dump(out, sys.stdout)
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="folder for census_barriers.json")
    args = ap.parse_args()
    res = compile_in_child(_COMPILE, ROOT)
    import triton
    res["meta"] = {"triton": triton.__version__, "target": "sm_90a (cuda 90)"}
    for k, v in res["gemm"].items():
        print(f"GEMM loop, {k}: {v['bar.sync']} bar.sync, {v['fence.proxy.async']} fence.proxy.async a step")
    for k, v in res["probe"].items():
        print(f"warp-specialized ring, {k} loop: {v}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "census_barriers.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
