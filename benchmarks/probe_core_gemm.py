"""Does the plain-core path gain from its own fp8 GEMM with the output transform in the epilogue?

The plain-core path ran four kernels: the activation pass, the plain-core dequantize (e4m3(64 T)
into a scratch, at its memory floor), cuBLAS's fp8 GEMM z = x' T^T (bf16 [M, Np] written out),
and the pass over z (Hn, the row scales: z read again, y written). At 2048 tokens on the seed down
the pass over z is 16 µs and on gate_up 47 µs (docs/KERNELS.md, "Prefill", sixth measurement),
bytes a GEMM saves by applying Hn to its own accumulator: a [BM, 128] output block is one whole
Hadamard block, so the epilogue is one more tensor-core product with the exact +-1 matrix, as the
fused prefill kernel's epilogue (kernels/prefill.py) does. That GEMM is now the library's
(escha/kernels/core_gemm.py, ``core_gemm_kernel``: fp32 accumulation, the accumulator rounded to
bf16 as cuBLAS rounds z, then @ H_pm1 and the scales; its walk over the blocks a while loop), which
this probe launches a program a block or persistent; ``core_gemm_tma_kernel`` here is the same
walk with both operands loaded by TMA. It times the path built on each (``core_path``) against the
path before (``cublas_path``). Its first two runs (results/core_gemm_h200/v1_9052833, v2_e73f1ea)
used its own copy of the kernel, its walk a loop over a constexpr count of blocks a program (git
history before bf296d4); the third (v3_library_ea8d00b) timed that copy beside the library's form:
within 1.5%.

Timing as the other probes: weights rotated past 4x L2, one CUDA graph an arm, device events,
interleaved rounds, median. Arms: cuBLAS bf16 and fp8, escha.matmul's rule, the library's
plain-core path (``serial``: since escha/kernels/core_gemm.py, this kernel's while-loop form from
core_gemm.MIN_M tokens, and ``gemm_library`` that GEMM alone), ``cublas_path`` (the same steps spelled out), ``core_<cfg>`` (the path
with core_gemm at each configuration), and the GEMMs alone on one fixed scratch (``gemm_cublas``:
cuBLAS then the pass over z; ``gemm_<cfg>``). Each path arm is gated against fp64 within the fp8
table first.

    python benchmarks/probe_core_gemm.py --out DIR [--ms 384,512,1024,2048,8192] [--shapes gate_up,down]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

from escha.kernels.common import CORE_FP8_SCALE, dot_dtype, hadamard_operand
from escha.kernels.core_gemm import core_gemm_kernel, store_block

# (BM, BK, warps, stages, persistent): 128-wide output blocks (one Hadamard block), e4m3
# operands. Not persistent: a program a block; persistent: one program an SM walking the blocks;
# "tma": persistent, both operands loaded by TMA (host tensor descriptors).
CONFIGS = {"128x128w8s4": (128, 128, 8, 4, False), "128x128w4s4": (128, 128, 4, 4, False),
           "256x128w8s3": (256, 128, 8, 3, False), "64x128w4s5": (64, 128, 4, 5, False),
           "128x128w8s4p": (128, 128, 8, 4, True), "128x128w8s4t": (128, 128, 8, 4, "tma"),
           "256x128w8s3t": (256, 128, 8, 3, "tma")}


@triton.jit
def core_gemm_tma_kernel(a_desc, b_desc, xscale_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, y_ptr, M, N_out, stride_ym,
                         num_blocks, Kp: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """The library's ``core_gemm_kernel`` persistent, with x' and the scratch loaded by TMA (rows past M read
    as zeros); GPU only."""
    num_m = tl.cdiv(M, BM)
    for b in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        pid_m = b % num_m
        pid_n = b // num_m
        acc = tl.zeros([BM, 128], dtype=tl.float32)
        for kk in range(Kp // BK):
            a = a_desc.load([pid_m * BM, kk * BK])
            w = b_desc.load([pid_n * 128, kk * BK])
            acc = tl.dot(a, w.T, acc)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * 128 + tl.arange(0, 128)
        store_block(acc, rows, rows < M, cols, xscale_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, y_ptr, N_out,
                    stride_ym)


def core_gemm(xq: torch.Tensor, xscale: torch.Tensor, t: torch.Tensor, qw, out: torch.Tensor, cfg: str) -> torch.Tensor:
    """The library's ``core_gemm_kernel`` of xq [M, Kp] e4m3 (scales [M]) against the e4m3(64 T) scratch t [Np, Kp]
    into out [M, out_features]."""
    bm, bk, warps, stages, persistent = CONFIGS[cfg]
    m, kp = xq.shape
    np_ = t.shape[0]
    h = hadamard_operand(xq.device, dot_dtype(torch.bfloat16))
    blocks = triton.cdiv(m, bm) * (np_ // 128)
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count if xq.is_cuda else 4
    grid = (min(blocks, sms) if persistent else blocks,)
    if persistent == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        a_desc = TensorDescriptor.from_tensor(xq, [bm, bk])
        b_desc = TensorDescriptor.from_tensor(t, [128, bk])
        core_gemm_tma_kernel[grid](a_desc, b_desc, xscale, h, qw.scale, qw.su, qw.gscale, out, m, qw.out_features,
                                   out.stride(0), blocks, Kp=kp, BM=bm, BK=bk, num_warps=warps, num_stages=stages)
        return out
    core_gemm_kernel[grid](xq, xscale, t, h, qw.scale, qw.su, qw.gscale, out, m, qw.out_features, xq.stride(0),
                           out.stride(0), blocks, Kp=kp, BM=bm, BK=bk, num_warps=warps, num_stages=stages)
    return out


def core_path(x: torch.Tensor, qw, t: torch.Tensor, cfg: str) -> torch.Tensor:
    """The plain-core path with ``core_gemm`` in place of cuBLAS and the pass over z."""
    from escha.kernels.actquant import prepare_actquant
    from escha.kernels.dequant import dequantize_core
    x2d = x.reshape(-1, x.shape[-1])
    dequantize_core(qw, torch.float8_e4m3fn, out=t)
    xq, xscale, _ = prepare_actquant(x2d, qw, True, None, keep=False)
    y = torch.empty((x2d.shape[0], qw.out_features), dtype=x.dtype, device=x.device)
    return core_gemm(xq, xscale, t, qw, y, cfg)


def cublas_path(x: torch.Tensor, qw, t: torch.Tensor) -> torch.Tensor:
    """The plain-core path before core_gemm: cuBLAS's fp8 GEMM writes z (bf16 [M, Np]), then the
    pass over z applies Hn and the row scales."""
    from escha.kernels.actquant import prepare_actquant
    from escha.kernels.common import constant_vector
    from escha.kernels.dequant import dequantize_core
    from escha.kernels.dequant_once import scaled_mm_rowwise
    from escha.kernels.transforms import hadamard_output_dense
    x2d = x.reshape(-1, x.shape[-1])
    dequantize_core(qw, torch.float8_e4m3fn, out=t)
    xq, xscale, _ = prepare_actquant(x2d, qw, True, None, keep=False)
    z = scaled_mm_rowwise(xq, t.t(), xscale, constant_vector(t.device, t.shape[0], 1.0 / CORE_FP8_SCALE.value))
    y = torch.empty((x2d.shape[0], qw.out_features), dtype=x.dtype, device=x.device)
    return hadamard_output_dense(z, qw, y)


def main() -> int:
    import escha
    from escha.bench.cuda_timing import GraphTimer
    from escha.format import dequantize
    from escha.kernels.actquant import prepare_actquant
    from escha.kernels.common import constant_vector
    from escha.kernels.dequant import dequantize_core
    from escha.kernels.dequant_once import dequant_core_fp8, scaled_mm_rowwise
    from escha.kernels.core_gemm import core_gemm as library_core_gemm
    from escha.kernels.transforms import hadamard_output_dense
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_decode import weight_set
    from bench_decode_wgmma import SHAPES, cublas_arms, dense_weights, fp8_weights, rel_err, start_run, time_arms

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="384,512,1024,2048,8192")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    args = ap.parse_args()
    fp8_tol = 0.077  # the fp8 paths' bound against fp64 (tests/test_decode_fp8.py)
    log, results = start_run(args.out, "core_gemm.log")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    cfgs = args.configs.split(",")
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        ws = weight_set(out_f, in_f, 4 * l2, seed=len(name), bits=2)
        w_ref = dequantize(ws[0]).double()
        t = torch.empty(ws[0].padded_shape, dtype=torch.float8_e4m3fn, device="cuda")
        t_fixed, _ = dequantize_core(ws[0], torch.float8_e4m3fn)
        inv = constant_vector(t.device, t.shape[0], 1.0 / CORE_FP8_SCALE.value)
        dense_rot = dense_weights(out_f, in_f, l2)
        fp8_rot = fp8_weights(dense_rot, l2)
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": name, "N": out_f, "K": in_f, "M": m, "bits": 2}
            try:
                xs = [torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                ref = xs[0].double() @ w_ref.T
                xq, xscale, _ = prepare_actquant(xs[0], ws[0], True, None, keep=False)
                y_fixed = torch.empty((m, out_f), dtype=torch.bfloat16, device="cuda")

                def gemm_cublas(i: int) -> torch.Tensor:
                    z = scaled_mm_rowwise(xq, t_fixed.t(), xscale, inv)
                    return hadamard_output_dense(z, ws[0], y_fixed)

                arms = {**cublas_arms(xs, dense_rot, fp8_rot),
                        "escha": (lambda i: escha.matmul(xs[i % 2], ws[i]), len(ws)),
                        "serial": (lambda i: dequant_core_fp8(xs[i % 2], ws[i]), len(ws)),
                        "cublas_path": (lambda i: cublas_path(xs[i % 2], ws[i], t), len(ws)),
                        "gemm_cublas": (gemm_cublas, 1),
                        "gemm_library": (lambda i: library_core_gemm(xq, xscale, t_fixed, ws[0], out=y_fixed), 1)}
                serial = cublas_path(xs[0], ws[0], t).clone()
                point["err_serial"] = rel_err(dequant_core_fp8(xs[0], ws[0]), ref)
                point["err_cublas_path"] = rel_err(serial, ref)
                for c in cfgs:
                    try:
                        y = core_path(xs[0], ws[0], t, c)
                        torch.cuda.synchronize()
                        e = rel_err(y, ref) if torch.isfinite(y).all() else float("nan")
                        point[f"err_core_{c}"] = e
                        point[f"vs_serial_{c}"] = float((y.float() - serial.float()).abs().max())
                    except Exception as exc:  # noqa: BLE001 (recorded: e.g. out of shared memory)
                        log(f"{name} M={m} {c}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    if e <= fp8_tol:
                        arms[f"core_{c}"] = (lambda i, c=c: core_path(xs[i % 2], ws[i], t, c), len(ws))
                        arms[f"gemm_{c}"] = (lambda i, c=c: core_gemm(xq, xscale, t_fixed, ws[0], y_fixed, c), 1)
                    else:
                        log(f"GATE FAIL {name} M={m} {c}: {e:.3e}")
                med = time_arms(timer, arms, args.rounds)
                point["us"] = med
                log(f"{name} M={m:5d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items()))
                log(f"{name} M={m:5d} errors " + " ".join(f"{k} {v:.3e}" for k, v in point.items()
                                                          if k.startswith(("err", "vs_"))))
            except Exception:
                log(f"{name} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "core_gemm.json"), "w") as f:
                json.dump(results, f, indent=1)
        del ws, w_ref, dense_rot, fp8_rot, t, t_fixed
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
