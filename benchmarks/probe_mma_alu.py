"""Does a warpgroup's asynchronous fp8 wgmma run while the same warps issue integer work?

    python benchmarks/probe_mma_alu.py --out DIR [--steps 400] [--rounds 5] [--alu 2,4,6,8] [--builds b256,b128]
    python benchmarks/probe_mma_alu.py --out DIR --launch b256:both_sync:4   # one launch, for ncu

The fp8 decode GEMM issues each step's MMAs asynchronously and decodes the next step before it
waits for them, yet its parts taken out (``probe_fp8_overlap.py``) add up as if the decode and the
MMAs ran in series. This probe asks the hardware the question without the codec, the activation
stream or the partials: a synthetic Gluon kernel (nothing here is a kernel of the library) whose
every step is

    [ALU rounds of integer work on VALS values a thread]  ->  [STSM + fence]  ->  issue the MMAs
    (both operands from shared memory, as the GEMM's)  ->  wait for the previous step's  ->  [CTA barrier]

in every program. Builds (``BUILDS``) mirror the fp8 GEMM's 256-token build (16 warps, four
warpgroups of m64n128k32 over a [128, 256] accumulator, one program an SM) and its 128-token one
(4 warps, m64n128, three programs an SM). Each integer round is four instructions a value (shf,
lop3, prmt on the ALU pipe, one mad.lo on the FMA pipe, or four mad.lo), one dependent chain a
value, VALS chains a thread: the decode's pipes, not its code. Forms, at each amount of integer work:

- ``alu``: the integer work alone (no MMA);
- ``mma``: the MMAs alone (ALU 0);
- ``both``: the two, the MMAs of step i in flight during step i + 1's integer work;
- ``both_sync``: ``both`` with the GEMM's CTA barrier after each wait;
- ``both_fence``: ``both_sync`` with the integer results stored to shared memory and fenced
  (``fence_async_shared``, MEMBAR.ALL.CTA in the SASS) before each issue, as the GEMM stores its
  decoded tile;
- ``ws_mma``, ``ws`` (256-token build only): warp-specialized, the product on 8 warps (two chained m64n128
  groups a step into a [128, 128] accumulator) and the same integer work on 8 more, twice the
  rounds each, nothing shared between the two partitions: the overlap across warps (``ws_mma``:
  its product alone, the integer warps idle).

Two integer mixes (``MIXES``): ``alu`` (three of the four instructions on the ALU pipe) and
``fma`` (all four mad.lo, the FMA pipe).

If the tensor core runs under the integer work, ``both`` takes about the longer of ``alu`` and
``mma``; if not, their sum. The forms are as named under triton 3.6, the release measured; 3.9
puts a CTA barrier after the wait in every MMA form (``both`` is then ``both_sync``) and places
the proxy fence itself. Cycles a step are the time over the steps at the SM clock of the
run's env record. Timing as the other probes: one CUDA graph an arm, rounds interleaved, median.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from escha.bench.cuda_timing import GraphTimer
from escha.kernels.triton_compat import cta_barrier

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_wgmma import start_run, time_arms  # noqa: E402

#: name: (warps_m, warps_n, tokens a program, programs an SM): the fp8 GEMM's 256- and 128-token builds
BUILDS = {"b256": (8, 2, 256, 1), "b128": (4, 1, 128, 3)}
WS_WORKER_REGS = gl.constexpr(64)  # registers a thread of the integer partition (16 values and their addresses)
VALS = gl.constexpr(16)  # independent integer chains a thread (the decode holds about this many values in flight)
#: Integer rounds, four instructions a value each, one dependent chain: ``alu`` mostly on the ALU
#: pipe (shf, lop3, prmt, and one mad.lo on the FMA pipe), ``fma`` all mad.lo (the FMA pipe).
MIXES = {
    "alu": gl.constexpr("shf.l.wrap.b32 $0, $1, $1, 5; lop3.b32 $0, $0, $1, 0x0F0F0F0F, 0x6A; "
                        "prmt.b32 $0, $0, $1, 0x5410; mad.lo.u32 $0, $0, 0x9E3779B9, $1;"),
    "fma": gl.constexpr("mad.lo.u32 $0, $1, 0x9E3779B9, $1; mad.lo.u32 $0, $0, 0x7FEB352D, $1; "
                        "mad.lo.u32 $0, $0, 0x846CA68B, $1; mad.lo.u32 $0, $0, 0x2C1B3C6D, $1;"),
}


@gluon.jit
def _probe_kernel(out_ptr, seed, STEPS, WM: gl.constexpr, WN: gl.constexpr, BN: gl.constexpr,
                  ALU: gl.constexpr, MMA_ON: gl.constexpr, SYNC: gl.constexpr, FENCE: gl.constexpr,
                  ROUND: gl.constexpr):
    NW: gl.constexpr = WM * WN
    ROWS: gl.constexpr = 16 * WM
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                  instr_shape=[16, BN // WN, 32])
    V: gl.constexpr = gl.BlockedLayout([VALS], [32], [NW], [0])
    Z: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [NW, 1], [1, 0])
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, 128],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, 128], gl.float8e4nv))
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, 128],
                                       gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv))
    s_smem = gl.allocate_shared_memory(gl.uint32, [NW * 32 * VALS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    a_smem.store(gl.zeros([ROWS, 128], gl.float8e4nv, layout=Z))
    b_smem.store(gl.zeros([BN, 128], gl.float8e4nv, layout=Z))
    fence_async_shared()
    cta_barrier()
    v = gl.arange(0, NW * 32 * VALS, layout=V).to(gl.uint32) + seed.to(gl.uint32)
    acc = gl.zeros([ROWS, BN], dtype=gl.float32, layout=MMA)
    for i in range(STEPS):
        for r in gl.static_range(ALU):
            v = gl.inline_asm_elementwise(ROUND, "=&r,r", [v], dtype=gl.uint32, is_pure=False, pack=1)
        if FENCE:
            s_smem.store(v)
            fence_async_shared()
        if MMA_ON:
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        if SYNC:
            cta_barrier()
    if MMA_ON:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    # Both results kept live, stored (to one word of the program's) only where they hold a value
    # they never hold here: no traffic, and no reduction (whose combine the CPU tests' interpreter
    # setting would turn into an interpreted function).
    p = gl.program_id(0)
    gl.store(out_ptr + p + gl.zeros([ROWS, BN], gl.int32, layout=MMA), acc, mask=acc == 12345.0)
    gl.store(out_ptr + p + gl.zeros([NW * 32 * VALS], gl.int32, layout=V), v.to(gl.float32, bitcast=True),
             mask=v == 0x7F7F7F7F)


@gluon.jit
def _ws_mma(out_ptr, a_smem, b_smem, STEPS, WM: gl.constexpr, BN: gl.constexpr):
    """The MMA partition of ``_ws_kernel``: WM warps issue each step's [16 WM, BN] product as
    BN / 128 chained m64n128k32 groups into one [16 WM, 128] accumulator (a wider one does not fit
    the 128 registers a thread of a 16-warp program), waited for a step late, as the GEMM's."""
    ROWS: gl.constexpr = 16 * WM
    CALLS: gl.constexpr = BN // 128
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, 1], instr_shape=[16, 128, 32])
    acc = gl.zeros([ROWS, 128], dtype=gl.float32, layout=MMA)
    for i in range(STEPS):
        for h in gl.static_range(CALLS):
            acc = warpgroup_mma(a_smem, b_smem.slice(h * 128, 128).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=CALLS, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    p = gl.program_id(0)
    gl.store(out_ptr + p + gl.zeros([ROWS, 128], gl.int32, layout=MMA), acc, mask=acc == 12345.0)


@gluon.jit
def _ws_alu(out_ptr, seed, STEPS, NW: gl.constexpr, ALU: gl.constexpr, ROUND: gl.constexpr):
    """The integer partition of ``_ws_kernel``: NW warps, ALU rounds a step on VALS values a thread."""
    V: gl.constexpr = gl.BlockedLayout([VALS], [32], [NW], [0])
    v = gl.arange(0, NW * 32 * VALS, layout=V).to(gl.uint32) + seed.to(gl.uint32)
    for i in range(STEPS):
        for r in gl.static_range(ALU):
            v = gl.inline_asm_elementwise(ROUND, "=&r,r", [v], dtype=gl.uint32, is_pure=False, pack=1)
    p = gl.program_id(0)
    gl.store(out_ptr + p + gl.zeros([NW * 32 * VALS], gl.int32, layout=V), v.to(gl.float32, bitcast=True),
             mask=v == 0x7F7F7F7F)


@gluon.jit
def _ws_kernel(out_ptr, seed, STEPS, WM: gl.constexpr, BN: gl.constexpr, ALU: gl.constexpr, ROUND: gl.constexpr):
    """Warp-specialized form: the kernel's WM warps issue the MMAs (the same [16 WM, BN] product a
    step as the other forms' builds), WM more warps do the integer rounds, with nothing between
    the two partitions: what the hardware overlaps across warps."""
    ROWS: gl.constexpr = 16 * WM
    Z: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WM, 1], [1, 0])
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROWS, 128],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, 128], gl.float8e4nv))
    b_smem = gl.allocate_shared_memory(gl.float8e4nv, [BN, 128],
                                       gl.NVMMASharedLayout.get_default_for([BN, 128], gl.float8e4nv))
    a_smem.store(gl.zeros([ROWS, 128], gl.float8e4nv, layout=Z))
    b_smem.store(gl.zeros([BN, 128], gl.float8e4nv, layout=Z))
    fence_async_shared()
    cta_barrier()
    gl.warp_specialize([(_ws_mma, (out_ptr, a_smem, b_smem, STEPS, WM, BN)),
                        (_ws_alu, (out_ptr, seed, STEPS, WM, ALU, ROUND))], [WM], [WS_WORKER_REGS])


FORMS = {"alu": (False, False, False), "mma": (True, False, False), "both": (True, False, False),
         "both_sync": (True, True, False), "both_fence": (True, True, True)}  # (MMA_ON, SYNC, FENCE)
# The warp-specialized form (``_ws_kernel``), timed in the builds of one program an SM only: with
# three (the 128-token build) its 8-warp programs need 255 registers a thread and would run one an SM.
WS = "ws"
WS_MMA = "ws_mma"  # its product alone (no integer rounds)


def _args(form: str, build: str, alu: int, mix: str) -> tuple:
    """(kernel, constexprs, warps of the launch) of one form."""
    wm, wn, bn, _ = BUILDS[build]
    if form in (WS, WS_MMA):  # the build's product on its warps_m warps, its integer work on as many more
        return _ws_kernel, {"WM": wm, "BN": bn, "ALU": alu * wn if form == WS else 0, "ROUND": MIXES[mix]}, wm
    mma_on, sync, fence = FORMS[form]
    return _probe_kernel, {"WM": wm, "WN": wn, "BN": bn, "ALU": 0 if form == "mma" else alu, "MMA_ON": mma_on,
                           "SYNC": sync, "FENCE": fence, "ROUND": MIXES[mix]}, wm * wn


def launch(form: str, build: str, alu: int, steps: int, out: torch.Tensor, mix: str = "alu") -> torch.Tensor:
    """One launch of the probe: one program for each slot of the build (programs an SM x SMs)."""
    kernel, constexprs, warps = _args(form, build, alu, mix)
    kernel[(out.numel(),)](out, 12345, steps, **constexprs, num_warps=warps)
    return out


def source(build: str, form: str, alu: int, mix: str = "alu"):
    """One form specialized as ``launch`` specializes it, for ``triton.compile`` off the GPU."""
    from triton.experimental.gluon._runtime import GluonASTSource
    kernel, constexprs, _ = _args(form, build, alu, mix)
    sig = {"out_ptr": "*fp32", "seed": "i32", "STEPS": "i32", **{k: "constexpr" for k in constexprs}}
    return GluonASTSource(kernel, sig, constexprs=constexprs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--alu", default="2,4,6,8", help="integer rounds a step (four instructions a value a round)")
    ap.add_argument("--builds", default="b256,b128")
    ap.add_argument("--mixes", default="alu,fma", help="integer mixes (MIXES)")
    ap.add_argument("--launch", default="", help="BUILD:FORM:ALU[:MIX]: launch that form once and stop (under ncu)")
    args = ap.parse_args()
    if args.launch:
        build, form, alu, *mix = args.launch.split(":")
        out = torch.empty(BUILDS[build][3] * torch.cuda.get_device_properties(0).multi_processor_count,
                          device="cuda", dtype=torch.float32)
        launch(form, build, int(alu), args.steps, out, *mix)
        torch.cuda.synchronize()
        return 0
    log, results = start_run(args.out, "probe_mma_alu.log")
    clock = float(results["env"]["clocks_mhz"].split(",")[-1])  # the max SM clock nvidia-smi reports
    results["sm_clock_mhz"] = clock
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    timer = GraphTimer(replays=10)
    for build in args.builds.split(","):
        out = torch.empty(BUILDS[build][3] * sms, device="cuda", dtype=torch.float32)
        for mix in args.mixes.split(","):
            for alu in [int(a) for a in args.alu.split(",")]:
                forms = [*FORMS, WS_MMA, WS] if BUILDS[build][3] == 1 else list(FORMS)  # see WS
                arms = {f: (lambda i, f=f: launch(f, build, alu, args.steps, out, mix), 1) for f in forms}
                med = time_arms(timer, arms, args.rounds)
                cyc = {k: v * clock / args.steps for k, v in med.items()}  # µs x MHz = cycles
                # where a form sits between the longer of the two parts (0: all hidden) and their sum
                # (1: in series); ws against its own product alone
                place = {}
                for k in ("both", "both_sync", "both_fence", WS):
                    mma = cyc[WS_MMA if k == WS else "mma"] if k in cyc else None
                    if mma is not None:
                        lo, hi = max(cyc["alu"], mma), cyc["alu"] + mma
                        place[k] = (cyc[k] - lo) / (hi - lo)
                results["points"].append({"build": build, "mix": mix, "alu_rounds": alu, "instructions_a_value": 4 * alu,
                                          "us": med, "cycles_per_step": cyc, "series_fraction": place})
                log(f"{build} {mix} x{alu}: " + " ".join(f"{k} {cyc[k]:6.0f}" for k in arms) + " cyc/step; series "
                    + " ".join(f"{k} {v:.2f}" for k, v in place.items()))
                with open(os.path.join(args.out, "probe_mma_alu.json"), "w") as f:
                    json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
