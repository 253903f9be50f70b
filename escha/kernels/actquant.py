"""Activation side of every prefill path: x -> x' = Hk (sv * pad(x)), optionally quantized to fp8.

Each program does the padding, the input signs and the 128-point block Hadamard transform (as a
tensor-core product with the exact +-1 Sylvester matrix) of one [BM, 128] block; the grid covers
(row blocks) x (k blocks). The fp8 variant needs a per-token absmax over the whole row, so it
runs two launches: pass 1 writes each block's per-row absmax to a small scratch [M, Kp/128];
pass 2 reduces a row's partials to its scale, recomputes its block's transform (x is read twice,
usually the second time from L2, but x' is never written in fp32) and stores e4m3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.spec import HAD_BLOCK
from .transforms import hadamard_pm1

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# The kernel multiplies by the unnormalized +-1 Hadamard matrix (exact in any dtype); this
# folds its 1/sqrt(128) back in, on the fp32 scale rather than on every element.
HAD_NORM = 1.0 / math.sqrt(HAD_BLOCK)


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
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=ok, other=0.0)
    sv = tl.load(sv_ptr + cols).to(tl.float32)  # sv is [Kp]: always in bounds
    # Sign flips and the +-1 matrix are exact, and the cast back to x's own dtype (DOT_DTYPE on
    # the GPU) is exact too; the dot accumulates in fp32.
    return tl.dot((x.to(tl.float32) * sv[None, :]).to(DOT_DTYPE), h)


@triton.jit
def absmax_kernel(x_ptr, sv_ptr, part_ptr, M, K, stride_xm, NKB: tl.constexpr, BM: tl.constexpr,
                  R: tl.constexpr, HB: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Pass 1: part[m, kb] = max |x'[m, kb*HB : +HB]| for rows [pid_m*R*BM, +R*BM) (R blocks of
    BM, which share one build of H) and k block pid_k.

    A block holding NaN or Inf records +Inf: max() may drop NaN on the GPU, while +Inf survives
    any order of maxima, so pass 2 can tell such rows apart from finite ones.
    """
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = hadamard_pm1(HB, DOT_DTYPE)
    for i in range(R):
        rows = (pid_m * R + i) * BM + tl.arange(0, BM)
        row_ok = rows < M
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, pid_k * HB, K, stride_xm, h, DOT_DTYPE, HB)
        bad = tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1)
        amax = tl.where(bad > 0, float("inf"), tl.max(tl.abs(v), axis=1))
        tl.store(part_ptr + rows * NKB + pid_k, amax, mask=row_ok)


@triton.jit
def quantize_kernel(x_ptr, sv_ptr, part_ptr, out_ptr, scale_ptr, M, K, stride_xm, stride_om,
                    NKB: tl.constexpr, NKB_P2: tl.constexpr, BM: tl.constexpr, R: tl.constexpr,
                    HB: tl.constexpr, DOT_DTYPE: tl.constexpr, FP8_MAX_C: tl.constexpr, NORM: tl.constexpr,
                    ROUND_FIRST: tl.constexpr):
    """Pass 2: reduce the row's NKB partial maxima to its scale, recompute x'[rows, k block] and
    store it in e4m3. Every program of a row block derives the same scale from the same partials
    (max is exact and order-free); the k-block-0 program stores it."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = hadamard_pm1(HB, DOT_DTYPE)
    j = tl.arange(0, NKB_P2)
    cols = pid_k * HB + tl.arange(0, HB)
    for i in range(R):
        rows = (pid_m * R + i) * BM + tl.arange(0, BM)
        row_ok = rows < M
        part = tl.load(part_ptr + rows[:, None] * NKB + j[None, :],
                       mask=row_ok[:, None] & (j[None, :] < NKB), other=0.0)
        amax = tl.max(part, axis=1)
        bad = amax == float("inf")
        amax = tl.where(bad, 1.0, tl.maximum(amax, 1e-30))  # an all-zero row: any positive scale is exact
        inv = FP8_MAX_C / amax
        if pid_k == 0:
            # A row with NaN/Inf gets a NaN scale, so its whole output row turns NaN, as it would
            # through the reference transform.
            tl.store(scale_ptr + rows, tl.where(bad, float("nan"), amax * (NORM / FP8_MAX_C)), mask=row_ok)
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, pid_k * HB, K, stride_xm, h, DOT_DTYPE, HB)
        q = tl.minimum(tl.maximum(v * inv[:, None], -FP8_MAX_C), FP8_MAX_C)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], to_e4m3(q, ROUND_FIRST),
                 mask=row_ok[:, None])


@triton.jit
def transform_bf16_kernel(x_ptr, sv_ptr, out_ptr, M, K, stride_xm, stride_om, BM: tl.constexpr,
                          R: tl.constexpr, HB: tl.constexpr, DOT_DTYPE: tl.constexpr, NORM: tl.constexpr,
                          ROUND_FIRST: tl.constexpr):
    """bf16 path, one pass: out[rows, k block] = bf16(x' / sqrt(128)) for R row blocks and k block pid_k."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = hadamard_pm1(HB, DOT_DTYPE)
    cols = pid_k * HB + tl.arange(0, HB)
    for i in range(R):
        rows = (pid_m * R + i) * BM + tl.arange(0, BM)
        row_ok = rows < M
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, pid_k * HB, K, stride_xm, h, DOT_DTYPE, HB)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 to_bf16(v * NORM, ROUND_FIRST), mask=row_ok[:, None])


@dataclass(frozen=True)
class ActQuantConfig:
    """Launch shape: BM rows per program (>= 16, the smallest tensor-core M); one 128-wide k
    block per program, so the grid is ceil(M / BM) x Kp/128."""

    block_m: int = 64
    num_warps: int = 4
    # Row blocks per program, R in (1, 2, 4, 8): the largest that still leaves >= min_programs
    # programs. Each program rebuilds the [128, 128] +-1 matrix from indices (~10 integer ops
    # per entry, 128 entries a thread at 4 warps against 64 loaded activations), so at large M
    # sharing it over R row blocks saves that work while the grid still fills the GPU.
    min_programs: int = 1024
    max_rows_per_prog: int = 8
    num_stages: int = 2  # with R > 1, the next row block's x loads overlap this block's math


def row_blocks_per_prog(m: int, nkb: int, cfg: "ActQuantConfig") -> int:
    """R for a call: the largest power of two <= cfg.max_rows_per_prog keeping the grid >= min_programs."""
    r = 1
    while (2 * r <= cfg.max_rows_per_prog
           and triton.cdiv(m, cfg.block_m * 2 * r) * nkb >= cfg.min_programs):
        r *= 2
    return r


_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

_WORKSPACE: dict[tuple, torch.Tensor] = {}


def workspace(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The reusable scratch for (device, current stream, dtype, shape); allocated on first use only.

    Two callers on one stream are ordered by the stream, so sharing is safe; a tensor from one
    call is overwritten by the next call of the same key, so callers never return it.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, dtype, tuple(shape))
    buf = _WORKSPACE.get(key)
    if buf is None:
        buf = torch.empty(shape, device=device, dtype=dtype)
        _WORKSPACE[key] = buf
    return buf


def partial_amax_workspace(device: torch.device, m: int, nkb: int) -> torch.Tensor:
    """fp32 scratch for the [m, nkb] partial maxima, from a workspace of a power-of-two capacity.

    Rounding the capacity up keeps the cache at O(log M) buffers over any mix of token counts
    (4 bytes per row and k block: 1.4 MB at M=8192, Kp=5120).
    """
    cap = 1 << max(10, (m * nkb - 1).bit_length())
    return workspace(device, torch.float32, (cap,))[: m * nkb]


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(absmax_kernel).__name__ == "InterpretedFunction"


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
    nkb = kp // HAD_BLOCK
    r = row_blocks_per_prog(m, nkb, cfg)
    grid = (triton.cdiv(m, cfg.block_m * r), nkb)
    ddt = dot_dtype(x2d.dtype)
    if not fp8:
        transform_bf16_kernel[grid](x2d, sv, out, m, x2d.shape[1], x2d.stride(0), out.stride(0),
                                    BM=cfg.block_m, R=r, HB=HAD_BLOCK, DOT_DTYPE=ddt, NORM=HAD_NORM,
                                    ROUND_FIRST=interpreted(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return out, None
    part = partial_amax_workspace(x2d.device, m, nkb)
    # NKB (= Kp/128) is a compile-time constant: one specialization per weight width (a handful
    # per model) and a constant-size reduction in pass 2.
    absmax_kernel[grid](x2d, sv, part, m, x2d.shape[1], x2d.stride(0), NKB=nkb, BM=cfg.block_m, R=r,
                        HB=HAD_BLOCK, DOT_DTYPE=ddt, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    quantize_kernel[grid](x2d, sv, part, out, scale, m, x2d.shape[1], x2d.stride(0), out.stride(0),
                          NKB=nkb, NKB_P2=triton.next_power_of_2(nkb), BM=cfg.block_m, R=r, HB=HAD_BLOCK,
                          DOT_DTYPE=ddt, FP8_MAX_C=FP8_MAX, NORM=HAD_NORM, ROUND_FIRST=interpreted(),
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out, scale

# Configuration note. The grid is (row blocks) x (128-wide k blocks): at M=512, K=5120 that is
# 8 x 40 = 320 programs per pass (the previous one-program-per-32-rows kernel had 16 and walked
# K twice in series, 92-176 us measured on the H200 for K=5120 against a 5-50 us byte floor).
# fp8 takes two launches because the per-token scale needs the whole row: pass 1 writes a
# per-(row, k block) absmax (4 bytes per 128 activations), pass 2 reduces the row's partials
# (NKB <= 68 floats for the shapes here, from L2), recomputes the block's transform from x
# (a second read of x, usually from L2, instead of a write and read of an fp32/bf16 copy) and
# stores e4m3. No atomics: max over the partials is exact and order-free, so the result is
# bitwise identical run to run. BM=64 at 4 warps holds one [64, 128] fp32 block (64 values a
# thread); the [128, 128] +-1 matrix is rebuilt per program from indices (integer ops only).
# New timings are to be measured (benchmarks/bench_prefill.py, arm part-actquant).
