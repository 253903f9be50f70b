"""Does the dequantize-once path gain from decoding the weight in row chunks beside its GEMM?

The plain-core path (``dequant_core_fp8``) runs in series: dequantize the whole core into the
e4m3 scratch (gate_up: 40.9 µs on the H200, at the memory floor of the bytes it moves,
docs/KERNELS.md "Prefill"), then the fp8 GEMM, then the output pass (Hn, row scales). The GEMM
itself is not bound by memory at 384-2048 tokens (gate_up at 512 tokens reads its 89 MB e4m3
weight in 78.5 µs: 1.1 TB/s of the 2.7 TB/s the device copies at), so the decode of the next
rows could run beside it. This probe splits the weight into C chunks of whole 128-row blocks
(``chunk_weights``: views of the stored tensors, no copy) and runs each chunk's dequantize on a
second stream while the chunks before it are multiplied and written out on the calling stream
(``overlapped``). The folded form (``dequant_fp8``, the rule's from about 48 tokens a 128-input
block: Hn in the scratch, no output pass) the same way, each chunk's GEMM writing its columns of
the output in place (``overlapped_folded``). Same outputs as the serial paths within the fp8
table (the GEMM is the same product, column by column); nothing in the library changes.

Timing as bench_decode_fp8.py: weights rotated over >= 4x L2, one CUDA graph an arm (both
streams captured), device events, interleaved rounds, median. Arms: cuBLAS bf16 and fp8
(row-wise scales, operands already e4m3), escha.matmul's rule, the serial plain-core and folded
paths, and ``overlap_C``, ``overlap_folded_C`` for C in --chunks, each gated against fp64 before it
is timed.

    python benchmarks/probe_dequant_overlap.py --out DIR [--ms 384,512,768,1024,2048] [--chunks 2,4,8]
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import traceback

import torch

import escha
from escha.bench.cuda_timing import GraphTimer
from escha.format import QuantizedWeight, dequantize
from escha.format.spec import HAD_BLOCK, TILE
from escha.kernels.actquant import prepare_actquant
from escha.kernels.codec import CodecPath
from escha.kernels.dequant import dequantize_core
from escha.kernels.common import CORE_FP8_SCALE, FP8_DTYPE, HN_FP8_SCALE, dot_dtype, hadamard_operand
from escha.kernels.dequant_once import (dequant_core_fp8, dequant_fp8, dequant_hn_kernel, dequant_once_config,
                                        k_per_prog_for, scaled_mm_rowwise)
from escha.kernels.transforms import hadamard_output_dense

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import weight_set  # noqa: E402
from bench_decode_wgmma import (SHAPES, cublas_arms, dense_weights, fp8_weights, rel_err,  # noqa: E402
                                start_run, time_arms)

FP8_TOL = 0.077  # the fp8 paths' bound on the whole call against fp64 (tests/test_decode_fp8.py)


def chunk_weights(qw: QuantizedWeight, chunks: int) -> list[tuple[int, int, QuantizedWeight]]:
    """(first row, end row, weight) of ``chunks`` row ranges of whole 128-row blocks, as even as
    the blocks allow: each a weight over views of ``qw``'s stored tensors (the trellis' tile
    rows, su and scale rows; sv and gscale whole), padded like ``qw`` in its last range."""
    blocks = qw.padded_shape[0] // HAD_BLOCK
    bounds = sorted({blocks * c // chunks * HAD_BLOCK for c in range(chunks + 1)})
    parts = []
    for r0, r1 in itertools.pairwise(bounds):
        rows = min(r1, qw.out_features) - r0
        tensors = [qw.trellis[r0 // TILE:r1 // TILE], qw.su[r0:r1], qw.sv, qw.scale[r0:r1], qw.gscale]
        parts.append((r0, r1, QuantizedWeight.trusted(tensors, (rows, qw.in_features), qw.bits, qw.codebook_id)))
    return parts


def overlapped(x: torch.Tensor, qw: QuantizedWeight, parts: list, scratch: torch.Tensor, inv: torch.Tensor,
               side: torch.cuda.Stream | None) -> torch.Tensor:
    """y = x @ W_hat^T by the plain-core path, chunk by chunk: chunk c's dequantize (into its rows
    of ``scratch``, e4m3 [Np, Kp]) on ``side`` while the calling stream multiplies and writes out
    the chunks before it; ``inv`` [Np] is the scratch's dequant multiplier (1/64) a row. ``side``
    None (no GPU): the same work in one stream."""
    x2d = x.reshape(-1, x.shape[-1])
    main = torch.cuda.current_stream() if side is not None else None
    if side is not None:
        side.wait_stream(main)  # the scratch is free once the calling stream's earlier work is done
    xq, xscale, _ = prepare_actquant(x2d, qw, True, None, keep=False)
    y = torch.empty((x2d.shape[0], qw.out_features), dtype=x.dtype, device=x.device)
    for r0, r1, qc in parts:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            dequantize_core(qc, FP8_DTYPE, out=scratch[r0:r1])
        if side is not None:
            main.wait_stream(side)  # this chunk's rows are decoded; the next chunk's decode follows on side
        z = scaled_mm_rowwise(xq, scratch[r0:r1].t(), xscale, inv[r0:r1])
        hadamard_output_dense(z, qc, y[:, r0:r0 + qc.out_features])
    return y.reshape(*x.shape[:-1], qw.out_features)


def dequant_hn_rows(qc: QuantizedWeight, w: torch.Tensor, wscale: torch.Tensor) -> None:
    """``dequant_hn(qc, fp8=True)`` (the rule's configuration and codec) into ``w`` (e4m3 rows of a
    larger scratch) and ``wscale``, not into the library's shared workspace."""
    cfg = dequant_once_config(qc, 1, qc.device)
    np_, kp = qc.padded_shape
    kb_total = kp // cfg.block_k
    kpp = k_per_prog_for(kb_total, cfg.k_per_prog)
    ddt = dot_dtype(torch.float16)
    h = hadamard_operand(qc.device, ddt, HN_FP8_SCALE.value)
    dequant_hn_kernel[(np_ // HAD_BLOCK, kb_total // kpp)](
        qc.trellis, qc.su, qc.scale, qc.gscale, h, w, wscale, w.stride(0), np_, KT=kp // TILE, BITS=qc.bits,
        BK=cfg.block_k, K_PER_PROG=kpp, OUT_FP8=True, DOT_DTYPE=ddt, USE_PTX=cfg.codec == CodecPath.PTX,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def overlapped_folded(x: torch.Tensor, qw: QuantizedWeight, parts: list, scratch: torch.Tensor, wscale: torch.Tensor,
                      y_full: torch.Tensor, side: torch.cuda.Stream) -> torch.Tensor:
    """The folded form (``dequant_fp8``: Hn and the row scales in the scratch, no output pass)
    chunk by chunk: chunk c's ``dequant_hn_kernel`` (into its rows of ``scratch`` and ``wscale``)
    on ``side`` while the calling stream runs the chunks before it, each GEMM writing its columns
    of ``y_full`` [M, Np] in place (``torch._scaled_mm``'s ``out``). GPU only."""
    x2d = x.reshape(-1, x.shape[-1])
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    xq, xscale, _ = prepare_actquant(x2d, qw, True, None, keep=False)
    for r0, r1, qc in parts:
        with torch.cuda.stream(side):
            dequant_hn_rows(qc, scratch[r0:r1], wscale[r0:r1])
        main.wait_stream(side)
        torch._scaled_mm(xq, scratch[r0:r1].t(), scale_a=xscale[:, None], scale_b=wscale[None, r0:r1],
                         out_dtype=torch.bfloat16, out=y_full[:, r0:r1])
    y = y_full[:, :qw.out_features]
    return (y.to(x.dtype).contiguous() if y.dtype != x.dtype or not y.is_contiguous() else y).reshape(
        *x.shape[:-1], qw.out_features)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ms", default="384,512,768,1024,2048")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--chunks", default="2,4,8")
    args = ap.parse_args()
    log, results = start_run(args.out, "dequant_overlap.log")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    side = torch.cuda.Stream()
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        ws = weight_set(out_f, in_f, 4 * l2, seed=len(name), bits=2)
        w_ref = dequantize(ws[0]).double()
        scratch = torch.empty(ws[0].padded_shape, dtype=FP8_DTYPE, device="cuda")
        inv = torch.full((ws[0].padded_shape[0],), 1.0 / CORE_FP8_SCALE.value, device="cuda")
        wscale_f = torch.empty(ws[0].padded_shape[0], dtype=torch.float32, device="cuda")
        parts = {c: [chunk_weights(w, c) for w in ws] for c in (int(v) for v in args.chunks.split(","))}
        dense_rot = dense_weights(out_f, in_f, l2)
        fp8_rot = fp8_weights(dense_rot, l2)
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": name, "N": out_f, "K": in_f, "M": m, "bits": 2}
            try:
                xs = [torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                arms = {
                    **cublas_arms(xs, dense_rot, fp8_rot),
                    "escha": (lambda i: escha.matmul(xs[i % 2], ws[i]), len(ws)),
                    "serial": (lambda i: dequant_core_fp8(xs[i % 2], ws[i]), len(ws)),
                    "serial_folded": (lambda i: dequant_fp8(xs[i % 2], ws[i]), len(ws)),
                }
                ref = xs[0].double() @ w_ref.T
                y_full = torch.empty((m, ws[0].padded_shape[0]), dtype=torch.bfloat16, device="cuda")

                def gate_arm(label: str, call) -> None:
                    """``call(i)`` (weight i, x alternated) as the arm ``label`` if its first call
                    is within the fp8 table of fp64; the error recorded either way."""
                    try:
                        y = call(0)
                        torch.cuda.synchronize()
                        e = rel_err(y, ref) if torch.isfinite(y).all() else float("nan")
                    except Exception as exc:  # noqa: BLE001 (recorded: e.g. a strided out refused)
                        log(f"{name} M={m} {label}: {type(exc).__name__}: {exc}"[:300])
                        return
                    point[f"err_{label}"] = e
                    if e <= FP8_TOL:
                        arms[label] = (call, len(ws))
                    else:
                        log(f"GATE FAIL {name} M={m} {label}: {e:.3e}")

                for c, pc in parts.items():
                    gate_arm(f"overlap_{c}", lambda i, pc=pc: overlapped(xs[i % 2], ws[i], pc[i], scratch, inv, side))
                for c, pc in parts.items():
                    gate_arm(f"overlap_folded_{c}", lambda i, pc=pc, y_full=y_full: overlapped_folded(
                        xs[i % 2], ws[i], pc[i], scratch, wscale_f, y_full, side))
                point["err_serial"] = rel_err(dequant_core_fp8(xs[0], ws[0]), ref)
                med = time_arms(timer, arms, args.rounds)
                point["us"] = med
                log(f"{name} M={m:5d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items()))
            except Exception:
                log(f"{name} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "dequant_overlap.json"), "w") as f:
                json.dump(results, f, indent=1)
        del ws, w_ref, dense_rot, fp8_rot, scratch, inv, wscale_f, parts
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
