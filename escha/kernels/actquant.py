"""Activation side of every prefill path: x -> x' = Hk (sv * pad(x)), optionally quantized to fp8.

Each program does the padding, the input signs and the 128-point block Hadamard transform (as a
tensor-core product with the exact +-1 Sylvester matrix, loaded from a cached device tensor: see
``common.hadamard_matrix``) of [BM, 128] tiles, ``tiles_per_prog`` of them strided by the grid.
The fp8 variant needs a per-token absmax over the whole row, so it
runs two launches: pass 1 writes each block's per-row absmax to a small scratch [M, Kp/128];
pass 2 reduces a row's partials to its scale, recomputes its block's transform (x is read twice,
usually the second time from L2, but x' is never written in fp32) and stores e4m3.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK
from .common import (FP8_DTYPE, FP8_MAX, INV_SQRT_HAD, check_operands, dot_dtype, hadamard_operand,
                     load_hadamard, prepare, round_to, workspace)


@triton.jit
def _transformed_block(x_ptr, sv_ptr, rows, row_ok, k0, K, stride_xm, h, DOT_DTYPE: tl.constexpr,
                       HB: tl.constexpr):
    """(sv * x)[rows, k0:k0+HB] @ H (unnormalized), fp32 [BM, HB]; columns >= K read as zero."""
    cols = k0 + tl.arange(0, HB)
    ok = row_ok[:, None] & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=ok, other=0.0)
    sv = tl.load(sv_ptr + cols).to(tl.float32)  # sv is [Kp]: always in bounds
    # Sign flips and the +-1 matrix are exact, and the cast back to x's own dtype (DOT_DTYPE on
    # the GPU) is exact too; the dot accumulates in fp32. fp32 operands take three TF32 passes:
    # a plain fp32 dot is one TF32 pass on the GPU, which rounds x to 11 significant bits.
    xs = x.to(tl.float32) * sv[None, :]
    if DOT_DTYPE == tl.float32:
        v = tl.dot(xs, h, input_precision="tf32x3")
    else:
        v = tl.dot(xs.to(DOT_DTYPE), h)
    return v


@triton.jit
def absmax_kernel(x_ptr, sv_ptr, h_ptr, part_ptr, M, K, stride_xm, T: tl.constexpr, NKB: tl.constexpr,
                  BM: tl.constexpr, HB: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Pass 1: part[m, kb] = max |x'[m, kb*HB : +HB]| for the T tiles (row block, k block)
    t = pid, pid + P, ..., pid + (T-1) P (P programs; t = row block * NKB + k block), which share
    one load of H (tiles past the last are masked: their rows are past M).

    A block holding NaN or Inf records +Inf: max() may drop NaN on the GPU, while +Inf survives
    any order of maxima, so pass 2 can tell such rows apart from finite ones.
    """
    h = load_hadamard(h_ptr)
    for i in range(T):
        t = tl.program_id(0) + i * tl.num_programs(0)  # past the last tile, rows are past M
        kb = t % NKB
        rows = (t // NKB) * BM + tl.arange(0, BM)
        row_ok = rows < M
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, kb * HB, K, stride_xm, h, DOT_DTYPE, HB)
        bad = tl.sum(((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32), axis=1)
        amax = tl.where(bad > 0, float("inf"), tl.max(tl.abs(v), axis=1))
        tl.store(part_ptr + rows * NKB + kb, amax, mask=row_ok)


@triton.jit
def quantize_kernel(x_ptr, sv_ptr, h_ptr, part_ptr, out_ptr, xscale_ptr, M, K, stride_xm, stride_om,
                    T: tl.constexpr, NKB: tl.constexpr, NKB_P2: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr,
                    DOT_DTYPE: tl.constexpr):
    """Pass 2, over pass 1's tiles: reduce the rows' NKB partial maxima to their scales, recompute
    x'[rows, k block] and store it in e4m3. Every tile of a row block derives the same scale from
    the same partials (max is exact and order-free); the k-block-0 tile stores it."""
    h = load_hadamard(h_ptr)
    j = tl.arange(0, NKB_P2)
    for i in range(T):
        t = tl.program_id(0) + i * tl.num_programs(0)  # past the last tile, rows are past M
        kb = t % NKB
        rows = (t // NKB) * BM + tl.arange(0, BM)
        row_ok = rows < M
        part = tl.load(part_ptr + rows[:, None] * NKB + j[None, :],
                       mask=row_ok[:, None] & (j[None, :] < NKB), other=0.0)
        amax = tl.max(part, axis=1)
        bad = amax == float("inf")
        amax = tl.where(bad, 1.0, tl.maximum(amax, 1e-30))  # an all-zero row: any positive scale is exact
        inv = FP8_MAX / amax
        # A row with NaN/Inf gets a NaN scale, so its whole output row turns NaN, as it would
        # through the reference transform.
        # (The k-block-0 tile's rows only: the condition goes into the bound, since Triton 3.9's
        # interpreter rejects a tensor mask combined with a scalar condition.)
        tl.store(xscale_ptr + rows, tl.where(bad, float("nan"), amax * (INV_SQRT_HAD / FP8_MAX)),
                 mask=rows < tl.where(kb == 0, M, 0))
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, kb * HB, K, stride_xm, h, DOT_DTYPE, HB)
        q = tl.minimum(tl.maximum(v * inv[:, None], -FP8_MAX), FP8_MAX)
        cols = kb * HB + tl.arange(0, HB)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], round_to(q, tl.float8e4nv),
                 mask=row_ok[:, None])


@triton.jit
def transform_bf16_kernel(x_ptr, sv_ptr, h_ptr, out_ptr, M, K, stride_xm, stride_om, T: tl.constexpr,
                          NKB: tl.constexpr, BM: tl.constexpr, HB: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """bf16 path, one pass over the tiles: out[rows, k block] = bf16(x' / sqrt(128))."""
    h = load_hadamard(h_ptr)
    for i in range(T):
        t = tl.program_id(0) + i * tl.num_programs(0)  # past the last tile, rows are past M
        kb = t % NKB
        rows = (t // NKB) * BM + tl.arange(0, BM)
        row_ok = rows < M
        v = _transformed_block(x_ptr, sv_ptr, rows, row_ok, kb * HB, K, stride_xm, h, DOT_DTYPE, HB)
        cols = kb * HB + tl.arange(0, HB)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
                 round_to(v * INV_SQRT_HAD, tl.bfloat16), mask=row_ok[:, None])


@dataclass(frozen=True)
class ActQuantConfig:
    """Launch parameters of the activation kernels; ``actquant_config`` is the rule that picks them.

    The work is tiles of [block_m rows, 128 columns] (one Hadamard block); each of the
    ceil(tiles / tiles_per_prog) programs takes tiles_per_prog of them, strided by the grid,
    sharing one load of the +-1 matrix and pipelining their x loads (num_stages).
    """

    block_m: int  # rows per tile (>= 16, the smallest tensor-core M)
    tiles_per_prog: int
    num_warps: int
    num_stages: int


def actquant_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> ActQuantConfig:
    """The rule: [64, 128] tiles, one a program, 4 warps, 3 stages, at every M (the note at the
    end of this file has the measurements; the device does not change the choice)."""
    return ActQuantConfig(block_m=64, tiles_per_prog=1, num_warps=4, num_stages=3)


def partial_amax_workspace(device: torch.device, m: int, nkb: int) -> torch.Tensor:
    """fp32 scratch for the [m, nkb] partial maxima, from a workspace of a power-of-two capacity.

    Rounding the capacity up keeps the cache at O(log M) buffers over any mix of token counts
    (4 bytes per row and k block: 1.4 MB at M=8192, Kp=5120).
    """
    cap = 1 << max(10, (m * nkb - 1).bit_length())
    return workspace(device, torch.float32, (cap,))[: m * nkb]


def actquant(x: torch.Tensor, qw: QuantizedWeight, *, fp8: bool = True,
             config: ActQuantConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., in] (fp16/bf16/fp32) -> (x' [M, Kp], xscale [M] or None), x' = Hk (sv * pad(x)).

    fp8=True: x' is float8_e4m3fn and x'_true[m] = x'[m].float() * xscale[m] (the Hadamard's
    1/sqrt(128) is inside the scale). fp8=False: x' is bfloat16, already normalized.
    ``config`` overrides ``actquant_config``.
    """
    check_operands(x, qw, "actquant")
    return prepare_actquant(x.reshape(-1, x.shape[-1]), qw, fp8, config, keep=False)[:2]


#: The per-call tensors of the prepared launches (prepare_actquant): bf16 pass, pass 1, pass 2.
BF16_SLOTS = ("x_ptr", "out_ptr")
ABSMAX_SLOTS = ("x_ptr", "part_ptr")
QUANTIZE_SLOTS = ("x_ptr", "part_ptr", "out_ptr", "xscale_ptr")


def prepare_actquant(x2d: torch.Tensor, qw: QuantizedWeight, fp8: bool, config: ActQuantConfig | None,
                     keep: bool) -> tuple[torch.Tensor, torch.Tensor | None, tuple | None]:
    """``actquant`` of x2d [M, in] (checked by the caller; any strides) and, with ``keep``, its
    launches prepared to run again (``common.Prepared``, slots ``BF16_SLOTS`` or ``ABSMAX_SLOTS``
    and ``QUANTIZE_SLOTS``), else (or where a launch keeps nothing, ``common.prepare``) None. x2d
    must have unit column stride for them to apply again: callers key on it."""
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    m, k = x2d.shape
    kp = qw.padded_shape[1]
    cfg = config or actquant_config(qw, m, x2d.device)
    out = torch.empty((m, kp), device=x2d.device, dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    xscale = torch.empty((m,), device=x2d.device, dtype=torch.float32) if fp8 else None
    if m == 0:
        return out, xscale, None
    nkb = kp // HAD_BLOCK
    grid = (triton.cdiv(triton.cdiv(m, cfg.block_m) * nkb, cfg.tiles_per_prog),)
    ddt = dot_dtype(x2d.dtype)
    h = hadamard_operand(x2d.device, ddt)
    # NKB (= Kp/128) is a compile-time constant: one specialization per weight width (a handful
    # per model) and a constant-size reduction in pass 2.
    settings = dict(T=cfg.tiles_per_prog, NKB=nkb, BM=cfg.block_m, HB=HAD_BLOCK, DOT_DTYPE=ddt,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fp8:
        args = (x2d, qw.sv, h, out, m, k, x2d.stride(0), out.stride(0))
        plans = (prepare(transform_bf16_kernel, grid, *args, slots=BF16_SLOTS if keep else None, **settings),)
    else:
        part = partial_amax_workspace(x2d.device, m, nkb)
        args1 = (x2d, qw.sv, h, part, m, k, x2d.stride(0))
        args2 = (x2d, qw.sv, h, part, out, xscale, m, k, x2d.stride(0), out.stride(0))
        plans = (prepare(absmax_kernel, grid, *args1, slots=ABSMAX_SLOTS if keep else None, **settings),
                 prepare(quantize_kernel, grid, *args2, slots=QUANTIZE_SLOTS if keep else None,
                         NKB_P2=triton.next_power_of_2(nkb), **settings))
    return out, xscale, None if None in plans else plans


def run_actquant(x2d: torch.Tensor, qw: QuantizedWeight, fp8: bool, prepared: tuple) -> tuple[torch.Tensor,
                                                                                            torch.Tensor | None]:
    """``prepare_actquant``'s launches again on a new x2d of the same key (unit column stride)."""
    m = x2d.shape[0]
    kp = qw.padded_shape[1]
    out = torch.empty((m, kp), device=x2d.device, dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    if not fp8:
        prepared[0].run(x2d, out)
        return out, None
    xscale = torch.empty((m,), device=x2d.device, dtype=torch.float32)
    part = partial_amax_workspace(x2d.device, m, kp // HAD_BLOCK)
    prepared[0].run(x2d, part)
    prepared[1].run(x2d, part, out, xscale)
    return out, xscale

# Configuration note. One tile a program: at M=512, K=5120 that is 8 x 40 = 320 programs per
# pass (the previous one-program-per-32-rows kernel had 16 and walked K twice in series,
# 92-176 us measured on the H200 for K=5120 against a 5-50 us byte floor).
# fp8 takes two launches because the per-token scale needs the whole row: pass 1 writes a
# per-(row, k block) absmax (4 bytes per 128 activations), pass 2 reduces the row's partials
# (NKB <= 68 floats for the shapes here, from L2), recomputes the block's transform from x
# (a second read of x, usually from L2, instead of a write and read of an fp32/bf16 copy) and
# stores e4m3. No atomics: max over the partials is exact and order-free, so the result is
# bitwise identical run to run. BM=64 at 4 warps holds one [64, 128] fp32 block (64 values a
# thread). The [128, 128] +-1 matrix was first rebuilt per program from indices: about ten
# integer ops per entry, 128 entries a thread at 4 warps against 64 activations, the cost the
# decode's transform kernels measured as their largest (docs/KERNELS.md); it is now loaded
# (32 KB, an L2 hit). That took pass 1 + pass 2 from 43.3 to 30.8 us at gate_up M=2048 and from
# 150.7 to 124.3 us at M=8192 (H200, benchmarks/results/prefill_h200_v3.log). With the matrix
# loaded, one row block a program was as fast or faster than the R > 1 row blocks the rule took
# before to share its build: 124.3 against 136.1 us at gate_up M=8192, 195.3 against 243.4 at
# down M=8192 (R = 8); [32, 128] blocks and [128, 128] at 8 warps are slower at every measured
# point. In the next run (prefill_h200_v4.log) 3 stages took 106.2 against 132.9 us at gate_up
# M=8192 and 183.6 against 227.1 at down M=8192, within 2% of 2 stages at M = 512 and 2048:
# 3 stages is the rule. R then gave way to tiles_per_prog (the same kernel at 1; a program's
# tiles strided by the grid, so the x loads of its next tile are in flight while it transforms
# one: cp.async in the PTX from 2 tiles up), whose 2, 4 and 8 are still to be timed
# (bench_prefill.py's -tN arms).
