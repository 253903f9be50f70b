"""Activation side of every prefill path: x -> x' = Hk (sv * pad(x)), optionally quantized to fp8.

One kernel does the padding, the input signs, the 128-point block Hadamard transform (as a
tensor-core product with the exact +-1 Sylvester matrix) and, for the fp8 paths, a per-token
absmax scale and the e4m3 cast. The fp8 variant makes two passes over the row (absmax, then
quantize) and recomputes the transform in the second instead of keeping it: the row is read
twice from L2 but never written in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.spec import HAD_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# The kernel multiplies by the unnormalized +-1 Hadamard matrix (exact in any dtype); this
# folds its 1/sqrt(128) back in, on the fp32 scale rather than on every element.
HAD_NORM = 1.0 / math.sqrt(HAD_BLOCK)


@triton.jit
def hadamard_pm1(BLOCK: tl.constexpr, dtype: tl.constexpr):
    """The unnormalized Sylvester matrix H[i, j] = (-1)**popcount(i & j), [BLOCK, BLOCK] in ``dtype``.

    Built from indices so that no constant tensor has to be copied to the device (a host copy
    is not allowed inside CUDA-graph capture).
    """
    i = tl.arange(0, BLOCK)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    a = i & j
    a = a ^ (a >> 4)
    a = a ^ (a >> 2)
    a = a ^ (a >> 1)
    return (1 - 2 * (a & 1)).to(dtype)


@triton.jit
def to_e4m3(v, ROUND_FIRST: tl.constexpr):
    """Cast to float8 e4m3 (round to nearest even).

    ROUND_FIRST (used under the interpreter) first rounds v to 3 mantissa bits in fp32 integer
    arithmetic, so the cast itself is exact: the interpreter's own cast drops the carry when
    rounding crosses a power of two (31.6 became 16, not 32). The GPU's cvt is correct and is
    used directly. Valid for e4m3's normal range, which the callers' scales target.
    """
    if ROUND_FIRST:
        b = v.to(tl.float32).to(tl.int32, bitcast=True)
        b = b + 0x7FFFF + ((b >> 20) & 1)
        v = (b & -1048576).to(tl.float32, bitcast=True)  # -1048576 == ~0xFFFFF
    return v.to(tl.float8e4nv)


@triton.jit
def to_bf16(v, ROUND_FIRST: tl.constexpr):
    """Cast fp32 to bf16, round to nearest even. ROUND_FIRST (interpreter only) rounds in integer
    arithmetic first: the interpreter's own cast truncates, doubling the rounding error."""
    if ROUND_FIRST:
        b = v.to(tl.float32).to(tl.int32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        v = (b & -65536).to(tl.float32, bitcast=True)  # -65536 == ~0xFFFF
    return v.to(tl.bfloat16)


@triton.jit
def _transformed_block(x_ptr, sv_ptr, rows, row_ok, k0, K, stride_xm, h, DOT_DTYPE: tl.constexpr,
                       HB: tl.constexpr):
    """(sv * x)[rows, k0:k0+HB] @ H (unnormalized), fp32 [BM, HB]; columns >= K read as zero."""
    cols = k0 + tl.arange(0, HB)
    ok = row_ok[:, None] & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)
    sv = tl.load(sv_ptr + cols).to(tl.float32)  # sv is [Kp]: always in bounds
    # Sign flips and the +-1 matrix are exact, and the cast back to x's own dtype (DOT_DTYPE on
    # the GPU) is exact too; the dot accumulates in fp32.
    return tl.dot((x.to(tl.float32) * sv[None, :]).to(DOT_DTYPE), h)


@triton.jit
def actquant_kernel(x_ptr, sv_ptr, out_ptr, scale_ptr, M, K, stride_xm, stride_om,
                    Kp: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr, OUT_FP8: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr, NORM: tl.constexpr,
                    ROUND_FIRST: tl.constexpr):
    """Rows [pid*BM, +BM) of x [M, K] -> out [M, Kp] (fp8 with scale[M], or bf16), see module doc."""
    pid = tl.program_id(0)
    rows = pid * BM + tl.arange(0, BM)
    row_ok = rows < M
    h = hadamard_pm1(HB, DOT_DTYPE)
    if OUT_FP8:
        amax = tl.zeros([BM], dtype=tl.float32)
        bad = tl.zeros([BM], dtype=tl.int32)
        for k0 in range(0, Kp, HB):
            v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, k0, K, stride_xm, h, DOT_DTYPE, HB)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
            # max() may drop NaN on the GPU; count non-finite values explicitly so that a row
            # holding NaN/Inf gets a NaN scale and its whole output row turns NaN, as it would
            # through the reference transform.
            bad += tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1)
        amax = tl.maximum(amax, 1e-30)  # an all-zero row: any positive scale is exact
        inv = FP8_MAX_C / amax
        scale = tl.where(bad > 0, float("nan"), amax * (NORM / FP8_MAX_C))
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        for k0 in range(0, Kp, HB):
            v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, k0, K, stride_xm, h, DOT_DTYPE, HB)
            q = tl.minimum(tl.maximum(v * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
            cols = k0 + tl.arange(0, HB)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], to_e4m3(q, ROUND_FIRST),
                     mask=row_ok[:, None])
    else:
        for k0 in range(0, Kp, HB):
            v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, k0, K, stride_xm, h, DOT_DTYPE, HB)
            cols = k0 + tl.arange(0, HB)
            tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], to_bf16(v * NORM, ROUND_FIRST),
                     mask=row_ok[:, None])


@dataclass(frozen=True)
class ActQuantConfig:
    """Launch shape: BM rows per program (>= 16, the smallest tensor-core M)."""

    block_m: int = 32
    num_warps: int = 4


_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(actquant_kernel).__name__ == "InterpretedFunction"


def dot_dtype(dtype: torch.dtype):
    """Operand dtype for a tensor-core product of values exact in ``dtype``.

    The interpreter's bf16 arithmetic is unreliable under numpy 2 (a bf16 tl.dot returned
    garbage), so interpreted runs use fp32, which holds every fp16/bf16 value exactly.
    """
    return tl.float32 if interpreted() else _DOT_DTYPES[dtype]


def actquant(x2d: torch.Tensor, sv: torch.Tensor, fp8: bool = True,
             config: ActQuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x2d [M, K] (fp16/bf16/fp32) and input signs sv [Kp] -> (x' [M, Kp], scale [M] or None).

    fp8=True: x' is float8_e4m3fn and x'_true[m] = x'[m].float() * scale[m] (the Hadamard's
    1/sqrt(128) is inside the scale). fp8=False: x' is bfloat16, already normalized.
    """
    if x2d.dim() != 2 or x2d.dtype not in _DOT_DTYPES:
        raise ValueError(f"actquant needs a 2-D fp16/bf16/fp32 tensor, got {x2d.dtype} {tuple(x2d.shape)}")
    kp = sv.numel()
    if kp % HAD_BLOCK or x2d.shape[1] > kp:
        raise ValueError(f"sv has {kp} entries; need a multiple of {HAD_BLOCK} >= K={x2d.shape[1]}")
    cfg = config or ActQuantConfig()
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    m = x2d.shape[0]
    out = torch.empty((m, kp), device=x2d.device, dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    scale = torch.empty((m,), device=x2d.device, dtype=torch.float32) if fp8 else None
    if m == 0:
        return out, scale
    grid = (triton.cdiv(m, cfg.block_m),)
    # Kp is a compile-time constant: one specialization per weight width (a handful per model),
    # and constant loop bounds, which Triton's interpreter needs under numpy 2.
    actquant_kernel[grid](x2d, sv, out, scale if fp8 else out, m, x2d.shape[1],
                          x2d.stride(0), out.stride(0), Kp=kp, BM=cfg.block_m, HB=HAD_BLOCK, OUT_FP8=fp8,
                          DOT_DTYPE=dot_dtype(x2d.dtype), FP8_MAX_C=FP8_MAX, NORM=HAD_NORM,
                          ROUND_FIRST=interpreted(), num_warps=cfg.num_warps)
    return out, scale

# Configuration note. BM=32 keeps one program's [32, 128] fp32 block in registers at 4 warps. The
# kernel is NOT at its memory floor: measured on the H200 it takes 92-176 us for K=5120 and
# 161-284 us for K=8704 at M=512..8192 (benchmarks/results/prefill.md), where its bytes need
# 5-50 us. One program per 32 rows walks all of K twice in series, so M=512 gives 16 programs on
# 132 SMs. The next step is a grid over (rows, K blocks) with per-block absmax and a quantize pass.
