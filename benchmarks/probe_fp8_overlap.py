"""Where the fp8 decode GEMM's step spends its time: the GEMM timed whole and with its parts taken
out (does the decode run under the MMAs? what do the activation stream and the partials cost?).

    python benchmarks/probe_fp8_overlap.py --out DIR [--ms 128,256] [--shapes gate_up,down] [--rounds 5]
        [--stages 2,3,4,5]

The GEMM alone (``decode_fp8.gemm_partials``, the rule's configuration at each point), in nine
forms built from today's ``escha/kernels/decode_fp8.py`` by editing its source in a temporary
folder (nothing here is a kernel of the library):

- ``whole``: the file as it is;
- ``no_mma``: the step's ``warpgroup_mma`` left out (the accumulator stays zero): decode, stores,
  the activation ring and every barrier, no tensor-core work;
- ``no_decode``: the decoded tile replaced by zeros (the words' loads go with it): the ring, the
  barriers and the MMAs, no codec;
- ``neither``: both left out: the ring, the barriers, the tile's stores and the partials' stores;
- ``no_stream``: the activation ring's refills and waits left out (each step multiplies whatever
  its stage holds after the first STAGES tiles): decode, MMAs and barriers without the L2 reads;
- ``no_store``: the partials' stores behind a branch never taken (the accumulator stays live);
- ``no_stream_no_store``: both of the last two: the decode, the MMAs and the barriers;
- ``no_fence``: the proxy fence between the decoded tile's stores and the MMAs that read it left
  out (MEMBAR.ALL.CTA and FENCE.VIEW.ASYNC.S in the SASS): what the fence costs with the previous
  step's MMAs in flight (``probe_mma_alu.py``). Without it the MMAs may read a stale tile: timing only
  (under triton 3.6, the release measured: 3.9 places the fence itself where it is left out);
- ``wait_first``: the previous step's MMAs waited for (wait_group 0) after this step's decode and
  before its tile's stores and fence (the wait after the issue left, with nothing to wait for):
  the fence with no MMA in flight; the same retirement order, so legal (gated as ``whole``).
(A form with neither the decode, the MMAs nor the stream crashed triton 3.6.0's ptxas 12.8, offline.
The forms ``tokens`` and ``tokens4``, fp32 partials stored token-major, timed against the fp32
partials the GEMM had then, are in git history at 71f6154: the 64- and 128-token builds store bf16
pairs since, which the output transform reads with no layout change.)

Beside them ``stream``: a plain Triton kernel that reads the same activation tiles on the same grid
and does nothing else (what the activation ring's bytes alone cost). ``--stages`` adds the whole
and no_decode forms at other ring depths (``whole_sN``, ``no_decode_sN``).

If the decode ran under the MMAs, ``whole`` would take about the longer of ``no_mma`` and
``no_decode``; if they ran in series, about ``neither`` plus what each of the two adds to it.
Each step's cycles are the time over the longest program's steps at the maximum SM clock
``nvidia-smi`` reports. Only ``whole`` and ``wait_first`` are gated (their partials against the
exact product of their own operands, 2**-8, as tests/test_decode_fp8.py); ``no_fence``'s error is
recorded, not required; the others compute something else by design.
Timing as bench_decode_fp8.py: weights rotated past L2, one CUDA graph an arm, rounds
interleaved, median.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

import torch
import triton
import triton.language as tl

from escha.bench.cuda_timing import GraphTimer
from escha.kernels.decode_fp8 import PROGRAMS_PER_SM, partial_values
from escha.kernels.decode_wgmma import summed_partials
from escha.kernels.transforms import prepare_input

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import load_previous  # noqa: E402
from bench_decode_wgmma import packed_weights, start_run, time_arms  # noqa: E402

SOURCE = os.path.join(os.path.dirname(__file__), "..", "escha", "kernels", "decode_fp8.py")
MMA = ("            acc = warpgroup_mma(a_smem.index(ab), x_smem.index(stage).permute((1, 0)), acc, use_acc=kb != k0,\n"
       "                                is_async=True)\n")
DECODE = "            a_smem.index(ab).store(_decoded_fp8(w, BITS, L8, ROWS))\n"
WAIT = "            mbarrier.wait(bars.index(stage), phase)\n"
REFILL = ("                mbarrier.expect(bars.index(rs), nbytes, pred=j < n)\n"
          "                tma_async_load(x_desc, [row0, kb_in * 128], bars.index(rs), x_smem.index(rs), pred=j < n)\n")
FENCE = "            fence_async_shared()\n"
WAIT1 = "            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))\n"
# The previous step's MMAs retired after this step's decode and before its tile is stored and fenced
# (the same order of retirement as the wait a step late after the issue: legal, and gated). The
# wait a step late stays after the issue, where nothing is left for it to wait for: it is what
# turns the issued accumulator back into the tensor the loop carries.
WAIT_FIRST = ("            a_tile = _decoded_fp8(w, BITS, L8, ROWS)\n"
              "            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))\n"
              "            a_smem.index(ab).store(a_tile)\n")
STORE = "        _store_rows(ws_ptr, acc, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN, ROWS, MMA, PAIRS)\n"
NO_STORE = "        if M < 0:  # never: the accumulator stays live, nothing is stored\n    " + STORE
ZEROS = ("            a_smem.index(ab).store(gl.zeros([ROWS, 128], gl.float8e4nv, layout=gl.BlockedLayout(\n"
         "                [1, 16], [8, 4], [NW, 1], [1, 0])))\n")


def no_stream(src: str) -> str:
    """``src`` without the activation ring's refills and waits."""
    return src.replace(WAIT, "").replace(REFILL, "                pass\n")


def variants(folder: str) -> dict:
    """{name: module} of the nine forms, each from an edited copy of decode_fp8.py."""
    with open(SOURCE) as f:
        src = f.read()
    assert all(src.count(t) == 1 for t in (MMA, DECODE, WAIT, REFILL, STORE, FENCE, WAIT1)), \
        "decode_fp8.py's step changed: edit the probe"
    forms = {"whole": src, "no_mma": src.replace(MMA, ""), "no_decode": src.replace(DECODE, ZEROS),
             "neither": src.replace(MMA, "").replace(DECODE, ZEROS),
             "no_stream": no_stream(src),
             "no_store": src.replace(STORE, NO_STORE),
             "no_stream_no_store": no_stream(src).replace(STORE, NO_STORE),
             "no_fence": src.replace(FENCE, ""),
             "wait_first": src.replace(DECODE, WAIT_FIRST)}
    mods = {}
    for name, text in forms.items():
        path = os.path.join(folder, f"decode_fp8_{name}.py")
        with open(path, "w") as f:
            f.write(text)
        mods[name] = load_previous(path)
    return mods


@triton.jit
def _stream_kernel(x_ptr, out_ptr, NKB, STRIDE, STEPS, PROGRAMS, BN: tl.constexpr):
    """Program (p, token block) reads the activation tiles [BN, 128] of its even-split steps, as the
    GEMM's ring does, and nothing else: the activation stream alone."""
    p = tl.program_id(0)
    tb = tl.program_id(1)
    s0 = (p * STEPS) // PROGRAMS  # under 2**31 at these sizes
    s1 = ((p + 1) * STEPS) // PROGRAMS
    rows = tb * BN + tl.arange(0, BN)
    cols = tl.arange(0, 128)
    acc = tl.zeros([BN, 128], dtype=tl.int32)
    for s in range(s0, s1):
        kb = s % NKB
        acc += tl.load(x_ptr + rows[:, None].to(tl.int64) * STRIDE + kb * 128 + cols[None, :]).to(tl.int32)
    tl.store(out_ptr + p * tl.num_programs(1) + tb, tl.sum(tl.sum(acc, 1), 0))


def stream(xq: torch.Tensor, steps: int, cfg, out: torch.Tensor) -> torch.Tensor:
    """The GEMM's activation reads alone (``_stream_kernel``), on its grid."""
    nkb = xq.shape[1] // 128
    grid = (cfg.programs, xq.shape[0] // cfg.block_tokens)
    _stream_kernel[grid](xq.view(torch.uint8), out, nkb, xq.stride(0), steps, cfg.programs, BN=cfg.block_tokens,
                         num_warps=cfg.warps_m * cfg.warps_n)
    return out


def fits(cfg, stages: int) -> bool:
    """Whether ``stages`` keeps the rule's programs an SM in shared memory (227 KB an SM, H100/H200)."""
    per_sm = PROGRAMS_PER_SM[cfg.block_tokens]
    return per_sm * (stages * cfg.block_tokens * 128 + 2 * 16 * cfg.warps_m * 128 + 1024) <= 227 * 1024


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--stages", default="", help="ring depths to time beside the rule's (arms whole_sN, no_decode_sN)")
    args = ap.parse_args()
    log, results = start_run(args.out, "probe_fp8_overlap.log")
    clock = float(results["env"]["clocks_mhz"].split(",")[-1])  # nvidia-smi's current, max SM clock
    results["sm_clock_mhz"] = clock
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    with tempfile.TemporaryDirectory() as folder:
        mods = variants(folder)
        for name in args.shapes.split(","):
            ws, _, _ = packed_weights(name, 2, l2, {})  # the words are packed once, in decode_wgmma's cache
            for m in [int(v) for v in args.ms.split(",")]:
                whole = mods["whole"]
                cfg = whole.decode_fp8_config(ws[0], m, torch.device("cuda"))
                x = torch.randn(m, ws[0].in_features, device="cuda", dtype=torch.bfloat16)
                rows = -(-m // cfg.block_tokens) * cfg.block_tokens
                xq, _, _ = prepare_input(x, ws[0], fp8=True, mma_order=True, rows=rows)
                # Gate of the unedited form: partials against the exact product of its own operands.
                a = whole.decoded_fragments(ws[0], cfg.warps_n).double()
                exact = xq[:m].double() @ a.T
                errs = {}
                for k in ("whole", "wait_first", "no_fence"):  # the last one is read, not required
                    part, counts = mods[k].gemm_partials(xq, ws[0], cfg, tokens=m)
                    got = summed_partials(partial_values(part, m), counts)
                    errs[k] = float((got - exact).norm() / exact.norm())
                err = max(errs["whole"], errs["wait_first"])
                ok = err <= 2.0**-8
                arms = {k: (lambda i, mod=mod: mod.gemm_partials(xq, ws[i], cfg, tokens=m), len(ws))
                        for k, mod in mods.items()}
                np_, kp = ws[0].padded_shape
                steps = (np_ // (16 * cfg.warps_m)) * (kp // 128)
                sink = torch.empty(cfg.programs * (xq.shape[0] // cfg.block_tokens), dtype=torch.int32, device="cuda")
                arms["stream"] = (lambda i: stream(xq, steps, cfg, sink), 1)
                for stages in [int(v) for v in args.stages.split(",") if v]:
                    if stages != cfg.stages and fits(cfg, stages):  # the same grid with a deeper (or shallower) ring
                        c = dataclasses.replace(cfg, stages=stages)
                        for k in ("whole", "no_decode"):
                            arms[f"{k}_s{stages}"] = (lambda i, mod=mods[k], c=c: mod.gemm_partials(xq, ws[i], c, tokens=m),
                                                      len(ws))
                med = time_arms(timer, arms, args.rounds)
                per_program = -(-steps // cfg.programs)
                cycles = {k: v * 1e-6 * clock * 1e6 / per_program for k, v in med.items()}
                point = {"shape": name, "M": m, "config": cfg.__dict__, "us": med, "steps_per_program": per_program,
                         "activation_bytes": steps * cfg.block_tokens * 128 * (xq.shape[0] // cfg.block_tokens),
                         "cycles_per_step": cycles, "gate_partials_rel_err": err, "gate_ok": ok,
                         "partials_rel_err": errs}
                results["points"].append(point)
                log(f"{name} M={m} " + " ".join(f"{k} {v:6.1f} us ({cycles[k]:5.0f} cyc/step)" for k, v in med.items())
                    + f"  steps/program {per_program}  gate {err:.2e} {'ok' if ok else 'FAIL'} (no_fence {errs['no_fence']:.2e})")
                with open(os.path.join(args.out, "probe_fp8_overlap.json"), "w") as f:
                    json.dump(results, f, indent=1)
            ws = None  # the rotation set freed before the next shape's
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
