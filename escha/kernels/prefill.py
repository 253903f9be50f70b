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

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.spec import HAD_BLOCK, TILE, words_per_tile
from .actquant import dot_dtype, hadamard_pm1, interpreted, to_bf16, to_e4m3
from .codec import state_values

# Power-of-two factor applied to T before the e4m3 cast: exact, and it moves |T| < 4 up to
# |64 T| < 256 <= 448 so that small weights land in the normal range (min normal 2**-6).
W_FP8_SCALE = 64.0
BLOCK_N = HAD_BLOCK  # the epilogue transforms whole Hadamard blocks
BLOCK_K = 64  # one k step: 4 trellis tiles (128 spilled: see the note at the end)


@triton.jit
def trellis_offsets(tn0, tk0, KT, BN: tl.constexpr, BK: tl.constexpr, KBITS: tl.constexpr):
    """Word offsets (w0, w1) and bit offsets of each weight of the [BN, BK] block at tile (tn0, tk0).

    Weight (n, k) is weight j = 16*(n%16) + k%16 of tile (n//16, k//16); its state is the 16-bit
    window at stream bit KBITS*j of that tile's cyclic stream, i.e. at bit (KBITS*j) % 32 of word
    (KBITS*j) // 32, running on into the next word (cyclically). Everything is a sum of a row
    vector and a column vector, so callers recompute it per block from two small vectors instead
    of keeping three [BN, BK] tensors live across the loop (that cost 192 registers a thread and
    spilled, measured with ptxas at BM=128).
    """
    W: tl.constexpr = 8 * KBITS
    n = tl.arange(0, BN)
    k = tl.arange(0, BK)
    row_bit = (KBITS * 16) * (n % 16)
    col_bit = KBITS * (k % 16)
    row_tile = (tn0 + n // 16) * (KT * W)
    col_tile = (tk0 + k // 16) * W
    bit = row_bit[:, None] + col_bit[None, :]
    widx = bit >> 5
    tile = row_tile[:, None] + col_tile[None, :]
    return tile + widx, tile + (widx + 1) % W, bit & 31


@triton.jit
def prefill_kernel(xq_ptr, sx_ptr, tr_ptr, su_ptr, cscale_ptr, gscale_ptr, y_ptr,
                   M, N, stride_xm, stride_ym,
                   Kp: tl.constexpr, KT: tl.constexpr, KBITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   W_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, EPI_DTYPE: tl.constexpr,
                   ROUND_FIRST: tl.constexpr, OUT_BF16: tl.constexpr,
                   USE_PTX: tl.constexpr):
    """y[pid_m*BM.., pid_n*BN..] for fp8 xq [M, Kp] with scales sx [M] and trellis words [Np/16, KT, 8K]."""
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
        o0, o1, off = trellis_offsets(pid_n * (BN // 16), kk * (BK // 16), KT, BN, BK, KBITS)
        w0 = tl.load(tr_ptr + o0)
        w1 = tl.load(tr_ptr + o1)
        t = state_values(w0, w1, off, USE_PTX)
        w8 = to_e4m3(t * W_SCALE, ROUND_FIRST)
        acc = tl.dot(a, tl.trans(w8), acc)
        a_ptrs += BK
    # Output Hadamard: acc @ H (H symmetric, +-1 exact in bf16). bf16 keeps fp32's range, so no
    # overflow for any activation scale; its 2**-9 rounding is far under the fp8 operands' error.
    h = hadamard_pm1(BN, EPI_DTYPE)
    z = tl.dot(acc.to(EPI_DTYPE), h)
    cols = pid_n * BN + tl.arange(0, BN)
    r = (tl.load(cscale_ptr + cols).to(tl.float32) * tl.load(su_ptr + cols).to(tl.float32)
         * tl.load(gscale_ptr) * OUT_SCALE)
    sx = tl.load(sx_ptr + rows, mask=row_ok, other=0.0)
    y = z * sx[:, None] * r[None, :]
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    if OUT_BF16:
        y = to_bf16(y, ROUND_FIRST)
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < N))


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape of the fused kernel: rows per program, warps, software-pipeline depth."""

    block_m: int = 128
    num_warps: int = 8
    # 1: no software pipelining. With 2+ stages Triton's pipeliner stages the loop's [128, 128]
    # int32 word gathers in shared memory (64 KB per load per stage): 320 KB at 3 stages, over
    # the H200's 227 KB, measured as an OutOfResources launch failure.
    num_stages: int = 1


# Configurations by M (see the note at the end of this file for the measurements behind them).
SMALL_M_CONFIG = PrefillConfig(block_m=64, num_warps=4, num_stages=1)
LARGE_M_CONFIG = PrefillConfig(block_m=256, num_warps=8, num_stages=1)
LARGE_M_MIN = 128  # from this M on, a 256-row block has at most half its rows padding


def prefill_config(m: int) -> PrefillConfig:
    """The configuration used for M rows when none is given."""
    return LARGE_M_CONFIG if m >= LARGE_M_MIN else SMALL_M_CONFIG


def prefill_matmul_q(xq: torch.Tensor, sx: torch.Tensor, trellis: torch.Tensor, su: torch.Tensor,
                     cscale: torch.Tensor, gscale: torch.Tensor, out_features: int, bits: int,
                     out_dtype: torch.dtype, config: PrefillConfig | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, out_features] from already-quantized activations (actquant) and the weight's tensors."""
    m, kp = xq.shape
    tn, kt, nw = trellis.shape
    if xq.dtype != torch.float8_e4m3fn or sx.shape != (m,) or sx.dtype != torch.float32:
        raise ValueError("xq must be float8_e4m3fn [M, Kp] with float32 scales [M]")
    if kt * TILE != kp or nw != words_per_tile(bits) or tn * TILE < out_features:
        raise ValueError(f"trellis {tuple(trellis.shape)} does not match Kp={kp}, K={bits}, "
                         f"out={out_features}")
    cfg = config or prefill_config(m)
    y = out if out is not None else torch.empty((m, out_features), device=xq.device, dtype=out_dtype)
    if m == 0:
        return y
    np_ = tn * TILE
    grid = (triton.cdiv(m, cfg.block_m) * (np_ // BLOCK_N),)
    # Kp and KT are compile-time constants: constant loop bounds and folded tile strides, one
    # specialization per weight width.
    prefill_kernel[grid](xq, sx, trellis, su, cscale, gscale, y, m, out_features,
                         xq.stride(0), y.stride(0), Kp=kp, KT=kt, KBITS=bits, BM=cfg.block_m, BN=BLOCK_N,
                         BK=BLOCK_K, W_SCALE=W_FP8_SCALE,
                         OUT_SCALE=1.0 / (W_FP8_SCALE * math.sqrt(HAD_BLOCK)),
                         EPI_DTYPE=dot_dtype(torch.bfloat16), ROUND_FIRST=interpreted(),
                         OUT_BF16=y.dtype == torch.bfloat16,
                         USE_PTX=xq.device.type == "cuda" and not interpreted(),
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y

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
