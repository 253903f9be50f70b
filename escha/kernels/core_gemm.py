"""The plain-core path's fp8 GEMM, with the output transform in its epilogue.

``dequant_core_fp8`` decodes the weight into a scratch of e4m3(64 T) and then needs
y = crop(xscale * ((x' T^T) Hn) * g*c*su / (64 sqrt(128))). Below ``MIN_M`` tokens it runs
cuBLAS's fp8 GEMM (z = x' T^T, bf16 [M, Np] written out) and a pass over z for Hn and the scales.
From ``MIN_M`` it runs this kernel instead: a [BM, 128] block of the product is one whole Hadamard
block, so the epilogue rounds the fp32 accumulator to bf16 (as cuBLAS rounds z), multiplies it by
the exact +-1 matrix on the tensor cores and scales it, and z never goes to memory.

Persistent: one program an SM walks the output blocks, rows fastest, so the programs resident at
one time share a weight block (it streams from memory once) while x' stays in L2. The walk is a
``while`` loop over a runtime block count (no recompile per M; the interpreter runs it too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.hadamard import sylvester_pm1
from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK
from .common import (CORE_FP8_SCALE, FP8_DTYPE, INV_SQRT_HAD, Prepared, device_capability, dot_dtype,
                     hadamard_operand, interpreted, load_hadamard, prepare, round_to, row_scale_block)


@triton.jit
def store_block(acc, rows, row_ok, cols, xscale_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, y_ptr, N_out, stride_ym):
    """y[rows, cols] = crop(xscale * (bf16(acc) H) * g*c*su / (64 sqrt(128))).

    z in bf16, as the library GEMM returns it; +-1 and bf16 are exact tensor-core operands, so the
    epilogue's product is cuBLAS's z times H, rounded once in fp32. (Interpreted, the operands are
    fp32 holding the same values: common.dot_dtype.)"""
    h = load_hadamard(h_ptr)
    z = tl.dot(round_to(acc, tl.bfloat16).to(h.dtype), h)
    r = row_scale_block(scale_ptr, su_ptr, gscale_ptr, cols, cols < N_out) * (INV_SQRT_HAD / CORE_FP8_SCALE)
    xs = tl.load(xscale_ptr + rows, mask=row_ok, other=0.0)
    y = z * xs[:, None] * r[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :], round_to(y, y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < N_out))


@triton.jit
def core_gemm_kernel(xq_ptr, xscale_ptr, t_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, y_ptr, M, N_out,
                     stride_xm, stride_ym, num_blocks, Kp: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    """Output blocks pid, pid + programs, ... (block b = rows (b % num_m) * BM.., columns
    (b // num_m) * 128..) of crop(xscale * ((x' T^T) H) * g*c*su / (64 sqrt(128)))."""
    num_m = tl.cdiv(M, BM)
    b = tl.program_id(0)
    while b < num_blocks:
        pid_m = b % num_m
        pid_n = b // num_m
        rows = pid_m * BM + tl.arange(0, BM)
        row_ok = rows < M
        cols = pid_n * 128 + tl.arange(0, 128)
        k = tl.arange(0, BK)
        a_ptrs = xq_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :]
        b_ptrs = t_ptr + cols[:, None].to(tl.int64) * Kp + k[None, :]
        acc = tl.zeros([BM, 128], dtype=tl.float32)
        for _ in range(0, Kp // BK):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(b_ptrs)
            acc = tl.dot(a, tl.trans(w), acc)
            a_ptrs += BK
            b_ptrs += BK
        store_block(acc, rows, row_ok, cols, xscale_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, y_ptr, N_out, stride_ym)
        b += tl.num_programs(0)


@dataclass(frozen=True)
class CoreGemmConfig:
    """Launch parameters of ``core_gemm_kernel``; ``core_gemm_config`` is the rule."""

    block_m: int  # token rows of an output block (its columns are one Hadamard block, 128)
    block_k: int
    num_warps: int
    num_stages: int


#: From this many tokens the plain-core path runs ``core_gemm`` (below: cuBLAS and the pass over z).
MIN_M = 1024
#: Programs of the persistent grid where there are no SMs to count (the interpreter, the offline
#: compile): fewer than the blocks of most tests, so the walk still loops.
INTERPRETED_PROGRAMS = 4
RULE_CONFIG = CoreGemmConfig(block_m=128, block_k=128, num_warps=8, num_stages=4)


def core_gemm_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> CoreGemmConfig | None:
    """The rule (note at the end of this file): None (cuBLAS and the pass over z) below ``MIN_M``
    tokens and on GPUs older than Hopper (where it was never timed), else ``RULE_CONFIG``."""
    device = device or qw.device
    if m < MIN_M:
        return None
    if device.type == "cuda" and not interpreted() and device_capability(device) < (9, 0):
        return None
    return RULE_CONFIG


def _check(xq: torch.Tensor, xscale: torch.Tensor, t: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> None:
    np_, kp = qw.padded_shape
    m = xq.shape[0] if xq.dim() == 2 else -1
    if xq.dtype != FP8_DTYPE or xq.dim() != 2 or xq.shape[1] != kp or xq.stride(1) != 1:
        raise ValueError(f"core_gemm: xq must be e4m3 [M, {kp}] with unit column stride, "
                         f"got {xq.dtype} {list(xq.shape)}")
    if xscale.dtype != torch.float32 or tuple(xscale.shape) != (m,) or not xscale.is_contiguous():
        raise ValueError(f"core_gemm: xscale must be a contiguous fp32 [{m}], got {xscale.dtype} {list(xscale.shape)}")
    if t.dtype != FP8_DTYPE or tuple(t.shape) != (np_, kp) or not t.is_contiguous():
        raise ValueError(f"core_gemm: t must be the contiguous e4m3 core [{np_}, {kp}], got {t.dtype} {list(t.shape)}")
    if tuple(out.shape) != (m, qw.out_features) or out.stride(1) != 1 or \
            out.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"core_gemm: out must be fp16/bf16/fp32 [{m}, {qw.out_features}] with unit column "
                         f"stride, got {out.dtype} {list(out.shape)}")
    devices = {v.device for v in (xq, xscale, t, out)} | {qw.device}
    if len(devices) != 1:
        raise ValueError(f"core_gemm: operands on several devices: {sorted(str(d) for d in devices)}")


def core_gemm(xq: torch.Tensor, xscale: torch.Tensor, t: torch.Tensor, qw: QuantizedWeight, *, out: torch.Tensor,
              config: CoreGemmConfig | None = None) -> torch.Tensor:
    """out[M, out_features] = crop(xscale * ((xq T^T) Hn) * g*c*su / (64 sqrt(128))), in out's dtype.

    xq: the activation pass's e4m3 x' [M, Kp] with its power-of-two scales xscale [M];
    t: the scratch of ``dequantize_core(qw, e4m3)``, e4m3(64 T) [Np, Kp]. ``config`` overrides
    ``core_gemm_config`` (which is None below ``MIN_M``: then ``RULE_CONFIG``)."""
    _check(xq, xscale, t, qw, out)
    cfg = config or core_gemm_config(qw, xq.shape[0], xq.device) or RULE_CONFIG
    prepare_core_gemm(xq, xscale, t, qw, out, cfg, keep=False)
    return out


def prepare_core_gemm(xq: torch.Tensor, xscale: torch.Tensor, t: torch.Tensor, qw: QuantizedWeight,
                      out: torch.Tensor, cfg: CoreGemmConfig, keep: bool) -> Prepared | None:
    """``core_gemm`` (operands checked by the caller) and, with ``keep``, its launch prepared to
    run again (slots ``xq_ptr``, ``xscale_ptr``, ``t_ptr``, ``y_ptr``), else None."""
    m, kp = xq.shape
    np_ = t.shape[0]
    blocks = triton.cdiv(m, cfg.block_m) * (np_ // HAD_BLOCK)
    if xq.is_cuda and not interpreted():
        programs = torch.cuda.get_device_properties(xq.device).multi_processor_count
    else:
        programs = INTERPRETED_PROGRAMS
    grid = (max(1, min(blocks, programs)),)
    h = hadamard_operand(xq.device, dot_dtype(torch.bfloat16))
    args = (xq, xscale, t, h, qw.scale, qw.su, qw.gscale, out, m, qw.out_features, xq.stride(0), out.stride(0),
            blocks)
    return prepare(core_gemm_kernel, grid, *args, slots=("xq_ptr", "xscale_ptr", "t_ptr", "y_ptr") if keep else None,
                   Kp=kp, BM=cfg.block_m, BK=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def core_gemm_reference(xq: torch.Tensor, xscale: torch.Tensor, t: torch.Tensor, qw: QuantizedWeight,
                        dtype: torch.dtype) -> torch.Tensor:
    """``core_gemm`` in PyTorch, step for step: z = bf16(xq T^T) (fp32 sums), then (z H) * xscale
    * (g*c*su / (64 sqrt(128))) in fp32, cropped and rounded to ``dtype``. Bit for bit the kernel's
    wherever the fp32 sums are exact (integer-valued operands, as the tests use); elsewhere they
    differ by the order of the fp32 additions."""
    m = xq.shape[0]
    np_ = t.shape[0]
    z = (xq.float() @ t.float().T).to(torch.bfloat16).float()
    h = sylvester_pm1(HAD_BLOCK, xq.device, torch.float32)
    zh = (z.reshape(m, np_ // HAD_BLOCK, HAD_BLOCK) @ h).reshape(m, np_)
    r = qw.gscale.float() * qw.scale.float() * qw.su.float() * (INV_SQRT_HAD.value / CORE_FP8_SCALE.value)
    y = zh[:, :qw.out_features] * xscale.float()[:, None] * r[None, :qw.out_features]
    return y.to(dtype)


# Configuration note. Measured on the H200 as benchmarks/probe_core_gemm.py (its persistent
# configuration "128x128w8s4p" was then this kernel's body with a constexpr count of blocks a program
# in place of the while loop; results/core_gemm_h200/v1_9052833, v2_e73f1ea; docs/KERNELS.md, "An fp8
# GEMM with Hn in its epilogue"): against cuBLAS's fp8 GEMM and the pass over z, the path with this
# GEMM was 3-7% faster at 1024 and 2048 tokens on both seed shapes in both runs (gate_up 2048:
# 409.9 against 431.5 us; down 2048: 212.7 against 229.1), lost 6-7% at down 512 and 13-15% at
# 8192 tokens (where the dispatcher takes the folded form, dequant-fp8, on the seed shapes). Hence
# MIN_M = 1024. Of the configurations timed (non-persistent 128x128 with 8 or 4 warps, 256x128,
# 64x128; persistent 128x128 and 256x128 with TMA loads), this one was the fastest at 1024-2048
# tokens or within 2% of the fastest (v2 gate_up 2048: persistent 256x128 by TMA 402.9 against
# 409.9 us; v1 gate_up 2048: non-persistent 256x128 410.2 against 403.7); TMA loads (host tensor
# descriptors) were no faster than the pipelined loads.
