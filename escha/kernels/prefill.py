"""Fused prefill GEMM: decode each weight tile in the kernel and multiply on fp8 tensor cores.

    y = diag(r) Hn (x' T^T),   x' = Hk (sv * x) quantized per token to e4m3 (kernels/actquant.py)

A program owns a [BM, 128] block of y. For each 128-wide k step it loads its fp8 activation block,
decodes the matching [128, 128] block of T from the trellis words (3INST, kernels/codec.py),
scales it by 64 into e4m3's normal range (T lies in (-4, 4), so 64*T lies in (-256, 256) and needs
no saturation), and accumulates x' (64 T)^T in fp32 on the tensor cores. The epilogue applies the
output Hadamard transform as one more tensor-core product with the exact +-1 matrix (BN equals the
Hadamard block, so a program holds whole blocks), then the per-token scale, the row scale
r = g*c*su and 1/(64*sqrt(128)), and stores y in the output dtype, cropped to the true N.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK, TILE
from ..norm import RowNorm
from .actquant import actquant
from .codec import CodecPath, codec_path, state_values
from .common import (ACTIVATION_DTYPES, CORE_FP8_SCALE, INV_SQRT_HAD, check_codebook, check_operands,
                     dot_dtype, hadamard_pm1, round_to, row_scale_block)

BLOCK_N = HAD_BLOCK  # the epilogue transforms whole Hadamard blocks
BLOCK_K = 64  # one k step: 4 trellis tiles (128 spilled: see the note at the end)


@triton.jit
def trellis_offsets(tn0, tk0, KT, BN: tl.constexpr, BK: tl.constexpr, BITS: tl.constexpr):
    """Word offsets (w0, w1) and bit offsets of each weight of the [BN, BK] block at tile (tn0, tk0).

    Weight (n, k) is weight j = 16*(n%16) + k%16 of tile (n//16, k//16); its state is the 16-bit
    window at stream bit BITS*j of that tile's cyclic stream, i.e. at bit (BITS*j) % 32 of word
    (BITS*j) // 32, running on into the next word (cyclically). Everything is a sum of a row
    vector and a column vector, so callers recompute it per block from two small vectors instead
    of keeping three [BN, BK] tensors live across the loop (that cost 192 registers a thread and
    spilled, measured with ptxas at BM=128).
    """
    W: tl.constexpr = 8 * BITS
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    row_bit = (BITS * 16) * (n % 16)
    col_bit = BITS * (k % 16)
    row_tile = (tn0 + n // 16) * (KT * W)
    col_tile = (tk0 + k // 16) * W
    bit = row_bit[:, None] + col_bit[None, :]
    widx = bit >> 5
    tile = row_tile[:, None] + col_tile[None, :]
    return tile + widx, tile + (widx + 1) % W, bit & 31


@triton.jit
def prefill_kernel(xq_ptr, xscale_ptr, tr_ptr, su_ptr, scale_ptr, gscale_ptr, y_ptr,
                   M, N, stride_xm, stride_ym,
                   Kp: tl.constexpr, KT: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, EPI_DTYPE: tl.constexpr, USE_PTX: tl.constexpr):
    """y[pid_m*BM.., pid_n*BN..] for fp8 xq [M, Kp] with scales xscale [M] and trellis words
    [Np/16, KT, 8K]."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    # m fastest: the programs resident at one time share a weight column block (decoded
    # separately, but its words stay hot in L2) and sweep the activation, which is what streams.
    pid_m = pid % num_m
    pid_n = pid // num_m
    rows = pid_m * BM + tl.arange(0, BM)
    row_ok = rows < M
    a_ptrs = xq_ptr + rows[:, None].to(tl.int64) * stride_xm + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kk in range(0, Kp // BK):
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        o0, o1, off = trellis_offsets(pid_n * (BN // 16), kk * (BK // 16), KT, BN, BK, BITS)
        w0 = tl.load(tr_ptr + o0)
        w1 = tl.load(tr_ptr + o1)
        t = state_values(w0, w1, off, USE_PTX)
        w8 = round_to(t * CORE_FP8_SCALE, tl.float8e4nv)
        acc = tl.dot(a, tl.trans(w8), acc)
        a_ptrs += BK
    # Output Hadamard: acc @ H (H symmetric, +-1 exact in bf16). bf16 keeps fp32's range, so no
    # overflow for any activation scale; its 2**-9 rounding is far under the fp8 operands' error.
    h = hadamard_pm1(BN, EPI_DTYPE)
    z = tl.dot(acc.to(EPI_DTYPE), h)
    cols = pid_n * BN + tl.arange(0, BN)
    r = row_scale_block(scale_ptr, su_ptr, gscale_ptr, cols, cols < N) * (INV_SQRT_HAD / CORE_FP8_SCALE)
    xs = tl.load(xscale_ptr + rows, mask=row_ok, other=0.0)
    y = z * xs[:, None] * r[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, round_to(y, y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the fused kernel; ``prefill_config`` is the rule that picks them."""

    block_m: int  # rows of y per program: each program decodes its weight slab once per row block
    num_warps: int
    # 1: no software pipelining. With 2+ stages Triton's pipeliner stages the loop's [128, 128]
    # int32 word gathers in shared memory (64 KB per load per stage): 320 KB at 3 stages, over
    # the H200's 227 KB, measured as an OutOfResources launch failure.
    num_stages: int
    codec: CodecPath


LARGE_M_MIN = 128  # from this M on, a 256-row block has at most half its rows padding


def prefill_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> PrefillConfig:
    """The rule (measurements in the note at the end of this file): 64-row blocks at 4 warps below
    M = 128, 256-row blocks at 8 warps from there; one stage; the device's codec path."""
    codec = codec_path(device or qw.device)
    if m >= LARGE_M_MIN:
        return PrefillConfig(block_m=256, num_warps=8, num_stages=1, codec=codec)
    return PrefillConfig(block_m=64, num_warps=4, num_stages=1, codec=codec)


def prefill(x: torch.Tensor, qw: QuantizedWeight, *, config: PrefillConfig | None = None,
            out: torch.Tensor | None = None, norm: RowNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T through the fused fp8 kernel, in x's dtype.

    The activations are transformed and quantized to e4m3 first (``actquant``, which applies
    ``norm``, the RMSNorm before the layer, when given: ``RowNorm.fusable``). ``config``
    overrides ``prefill_config``. ``out``, if given, is a preallocated [M, out_features] fp16,
    bf16 or fp32 tensor with unit column stride; y is written there in its dtype and returned.
    """
    check_operands(x, qw, "prefill")
    check_codebook(qw, "prefill")
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or prefill_config(qw, m, x.device)
    if out is None:
        y = torch.empty((m, qw.out_features), device=x.device, dtype=x.dtype)
    elif out.shape != (m, qw.out_features) or out.dtype not in ACTIVATION_DTYPES or out.stride(1) != 1:
        raise ValueError(f"out must be fp16/bf16/fp32 [{m}, {qw.out_features}] with unit column stride, "
                         f"got {out.dtype} {list(out.shape)} stride {out.stride()}")
    else:
        y = out
    if m:
        xq, xscale = actquant(x2d, qw, norm=norm)  # refuses a norm it cannot apply (transforms.check_norm)
        np_, kp = qw.padded_shape
        grid = (triton.cdiv(m, cfg.block_m) * (np_ // BLOCK_N),)
        # Kp and KT are compile-time constants: constant loop bounds and folded tile strides, one
        # specialization per weight width.
        prefill_kernel[grid](xq, xscale, qw.trellis, qw.su, qw.scale, qw.gscale, y, m, qw.out_features,
                             xq.stride(0), y.stride(0), Kp=kp, KT=kp // TILE, BITS=qw.bits, BM=cfg.block_m,
                             BN=BLOCK_N, BK=BLOCK_K, EPI_DTYPE=dot_dtype(torch.bfloat16),
                             USE_PTX=cfg.codec == CodecPath.PTX,
                             num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.reshape(*x.shape[:-1], qw.out_features)

# Configuration note. BN = 128 so a program holds whole Hadamard blocks for the fused epilogue.
# Each program decodes its whole [BN, Kp] weight slab once per row block, so a weight is decoded
# ceil(M / BM) times: BM is the amortization factor (the founding report's TM=8 lesson).
# Measured on the H200 (benchmarks/results/prefill.md, us, gate_up / down):
#     M      BM=128 (8 warps)    BM=256 (8 warps)
#     512     710 /  586          517 /  388
#     2048   2030 / 1186         1305 /  858
#     8192   8710 / 4528         4831 / 2613
# so BM=256 is the default from M=128 on, although ptxas reports 255 registers and ~1.1 KB of spills
# for it (BM=128: 124 bytes). BK = 64: with BK=128 the [128, 128] word gathers and codec
# temporaries spilled 620 bytes at BM=128. num_stages = 1: see PrefillConfig. The SASS holds
# QGMMA.64x128x32.F32.E4M3.E4M3 for the main loop (fp8 wgmma) and bf16 HGMMA for the epilogue.
# The kernel runs at 120-300 TFLOP/s against cuBLAS's 1100-1400: it is codec-bound (each
# 256-row block re-decodes the whole weight: 32 full decodes at M=8192), which is why the
# dispatcher sends M > 64 to the dequantize-once path.
