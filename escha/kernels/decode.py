"""Decode GEMM: y = x @ W_hat^T for 1..64 tokens, straight from the trellis words.

Structure (three launches at most, each a fixed-order computation, so results are bitwise
reproducible):

1. ``transforms.hadamard_input``: x' = Hk(sv * x) per token, fp16, scaled by a power of two.
2. ``_decode_kernel``: program (n-block, k-slice) decodes a [BLOCK_N, 16*BLOCK_KT] block of the
   core T per step (codec.decode_block) and accumulates z^T[BLOCK_N, BLOCK_M] += T_blk @ x'^T_blk
   with tl.dot in fp32. The weight block is the *left* operand (swap AB): 128 weight rows fill the
   MMA's M dimension and the 1..64 tokens pad only to BLOCK_M >= 16.
   With one k-slice and BLOCK_N = 128 it also applies the output transform in its epilogue
   (FUSE_OUTPUT) and writes y; otherwise it writes fp32 partials to a [SPLIT, M, Np] workspace.
3. ``transforms.hadamard_output``: sums the partials in order s = 0..SPLIT-1 (no atomics), applies
   Hn, g*c*su and the token scale, crops and writes y in x's dtype.

Precision: fp16 operands (T is exactly fp16; x' is rounded once to fp16), fp32 accumulation,
one final rounding to x's dtype. fp32 inputs are accepted and computed the same way (fp16
operands), with an fp32 output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK, TILE
from ..norm import HeadNorm, RowNorm
from .codec import CodecPath, codec_path, decode_block
from .common import (INV_SQRT_HAD, check_codebook, check_operands, hadamard_pm1, output_tensor, round_to,
                     row_scale_block)
from .splitk import decode_split_k
from .transforms import hadamard_input, hadamard_output

MAX_DECODE_M = 64


@triton.jit
def _decode_kernel(xq_ptr, tr_ptr, ws_ptr, y_ptr, scale_ptr, su_ptr, gscale_ptr, inv_ptr,
                   M, N_out, Np, Kp, KT, NKB, stride_ym, STEPS: tl.constexpr,
                   BITS: tl.constexpr, BN: tl.constexpr, BKT: tl.constexpr, BM: tl.constexpr,
                   SPLIT: tl.constexpr, FUSE_OUTPUT: tl.constexpr, USE_PTX: tl.constexpr,
                   ABLATION: tl.constexpr):
    """Program (nb, s): z^T rows nb*BN.. over k-blocks s*STEPS .. s*STEPS + STEPS - 1.

    STEPS = ceil(NKB / SPLIT) is constexpr: the CPU interpreter (numpy >= 2.4) cannot loop to a
    runtime bound. Steps past the last k-block re-decode block NKB-1 against zeroed activations,
    which adds exact zeros (3INST values are finite); only the last slices ever do so.
    ABLATION is 0 except in the benchmark's variants (escha.kernels._bench).
    """
    nb = tl.program_id(0)
    s = tl.program_id(1)
    BK: tl.constexpr = 16 * BKT
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    x_ptrs = xq_ptr + m[None, :] * Kp + kk[:, None]  # [BK, BM]: x'^T block
    x_mask = m[None, :] < M
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for i in range(STEPS):
        kb = s * STEPS + i
        kbc = tl.minimum(kb, NKB - 1)
        w = decode_block(tr_ptr, nb * (BN // 16), kbc * BKT, KT, BITS, BN, BKT, USE_PTX, ABLATION)
        # Past the last k-block no token row is live: the bound on m, not `x_mask & (kb < NKB)`
        # (Triton 3.9's interpreter rejects a tensor mask combined with a scalar condition).
        xb = tl.load(x_ptrs + kbc * BK, mask=m[None, :] < tl.where(kb < NKB, M, 0), other=0.0)
        acc = tl.dot(w, xb, acc)
    n = nb * BN + tl.arange(0, BN)[:, None]
    if FUSE_OUTPUT:
        # BN == 128: this program holds whole Hadamard blocks of z^T, so Hn is one more product.
        h = tl.dot(hadamard_pm1(BN, tl.float32), acc, input_precision="tf32x3") * INV_SQRT_HAD
        rs = row_scale_block(scale_ptr, su_ptr, gscale_ptr, n, n < N_out)
        inv = tl.load(inv_ptr + m[None, :], mask=x_mask, other=0.0)
        y = h * rs * inv
        tl.store(y_ptr + m[None, :] * stride_ym + n, round_to(y, y_ptr.dtype.element_ty),
                 mask=x_mask & (n < N_out))
    else:
        tl.store(ws_ptr + (s * M + m[None, :]) * Np + n, acc, mask=x_mask)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode GEMM; ``decode_config`` is the rule that picks them."""

    block_n: int  # weight rows per program (multiple of 16, divides 128 or is 128)
    block_kt: int  # 16-wide k-tiles decoded per loop step (BLOCK_K = 16 * block_kt)
    block_m: int  # token columns of the MMA (>= 16, power of two, >= M)
    split: int  # k-slices (deterministic fp32 workspace reduce when > 1)
    num_warps: int
    num_stages: int
    codec: CodecPath
    fuse_output: bool  # output transform in the GEMM epilogue when split == 1 and block_n == 128


def decode_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DecodeConfig:
    """The rule that picks the decode configuration for ``qw`` at ``m`` tokens on ``device``.

    * block_m: the next power of two >= m, at least 16 (tl.dot's smallest N).
    * block_n = 64, num_stages = 1, num_warps = 4, block_kt = 8 (BLOCK_K = 128): the H200 sweep
      (note at the end of this module). With block_n = 64 the output transform runs as its own
      kernel; fusing it (block_n = 128) measured no faster.
    * split: splitk.decode_split_k(nblk, ktiles), fitted on the H200.
    * codec: PTX on NVIDIA GPUs, pure Triton elsewhere (codec.codec_path).
    """
    if not 1 <= m <= MAX_DECODE_M:
        raise ValueError(f"decode handles 1..{MAX_DECODE_M} tokens, got {m}")
    np_, kp = qw.padded_shape
    split = decode_split_k(np_ // 128, kp // TILE)  # the rule was fitted in units of 128-row blocks
    return DecodeConfig(block_n=64, block_kt=8, block_m=max(16, triton.next_power_of_2(m)), split=split,
                        num_warps=4, num_stages=1, codec=codec_path(device or qw.device),
                        fuse_output=split == 1)


def decode(x: torch.Tensor, qw: QuantizedWeight, *, config: DecodeConfig | None = None,
           out: torch.Tensor | None = None, norm: RowNorm | None = None,
           head_norm: HeadNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T for 1..64 tokens (leading dims flattened), in x's dtype.

    x may be fp16, bf16 or fp32, any strides, on qw's device. ``config`` overrides decode_config.
    ``out``, if given, is a preallocated [M, out_features] tensor of x's dtype with unit column
    stride (M = tokens after flattening); it is filled and returned reshaped like x. ``norm``
    (weight of x's dtype) is applied to x first, in the input transform: norm(x) @ W_hat^T;
    ``head_norm`` to the output's heads, in the output transform.
    """
    return _launch(x, qw, config, out, norm=norm, head_norm=head_norm)[0]


def _launch(x: torch.Tensor, qw: QuantizedWeight, config: DecodeConfig | None, out: torch.Tensor | None,
           ablation: int = 0, norm: RowNorm | None = None,
           head_norm: HeadNorm | None = None) -> tuple[torch.Tensor, object]:
    """Check, allocate and launch ``decode``; returns (y, the compiled GEMM kernel).

    ``ablation`` selects a measurement-only variant (escha.kernels._bench); 0 is the real kernel.
    """
    check_operands(x, qw, "decode")
    check_codebook(qw, "decode")
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or decode_config(qw, m, x.device)
    np_, kp = qw.padded_shape
    if cfg.block_m < m or cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"block_m={cfg.block_m} must be a power of two >= max(16, M={m})")
    if HAD_BLOCK % cfg.block_n and cfg.block_n % HAD_BLOCK or cfg.block_n % 16 or np_ % cfg.block_n:
        raise ValueError(f"block_n={cfg.block_n} must be a multiple of 16 dividing Np={np_}")
    if (kp // TILE) % cfg.block_kt:
        raise ValueError(f"block_kt={cfg.block_kt} must divide the {kp // TILE} k-tiles")
    nkb = kp // TILE // cfg.block_kt
    split = max(1, min(cfg.split, nkb))
    fuse = cfg.fuse_output and split == 1 and cfg.block_n == HAD_BLOCK and head_norm is None
    xq, inv = hadamard_input(x2d, qw, norm=norm)
    y = output_tensor(x, m, qw.out_features, out)
    ws = y if fuse else torch.empty((split, m, np_), dtype=torch.float32, device=x.device)
    grid = (np_ // cfg.block_n, split)
    kernel = _decode_kernel[grid](xq, qw.trellis, ws, y, qw.scale, qw.su, qw.gscale, inv,
                                  m, qw.out_features, np_, kp, kp // TILE, nkb, y.stride(0),
                                  STEPS=triton.cdiv(nkb, split), BITS=qw.bits, BN=cfg.block_n,
                                  BKT=cfg.block_kt, BM=cfg.block_m, SPLIT=split, FUSE_OUTPUT=fuse,
                                  USE_PTX=cfg.codec == CodecPath.PTX, ABLATION=ablation,
                                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if not fuse:
        hadamard_output(ws, qw, inv, y, head_norm=head_norm)
    return y.reshape(*x.shape[:-1], qw.out_features), kernel


# -- Why the configuration is what it is ---------------------------------------------------------
# Measured on one H200 (torch 2.11+cu130, triton 3.6.0), CUDA graphs, weights rotated over >= 4x
# L2, median of 5 interleaved rounds; benchmarks/results/decode_h200_run1.log (sweep) and
# decode_h200.log (final). Microseconds, gate_up 17408x5120 / down 5120x8704:
#   start (block_n=128, 4 warps, 2 stages):        M=8  84.3 / 59.0    M=64 111.1 / 75.5
#   num_stages=1 (8 warps):                        M=8  63.0 / 46.1    M=64 103.9 / 71.6
#   block_n=64 (2 stages):                         M=8  63.6 / 44.8    M=64  96.5 / 63.6
#   block_n=64 + num_stages=1 (the default):       M=8  57.0 / 42.1    M=64  95.5 / 65.4
# Stages > 1 pipeline the word loads but the decoded tile's shared-memory staging then doubles
# and occupancy drops; the loop is issue-bound (docs/KERNELS.md census), so it loses.
# block_n=64 halves the per-program register tile and doubles programs at the same split.
# Fusing the output transform (block_n=128, split=1) measured no faster than the separate kernel.
# Split: splitk.decode_split_k, fitted on 18 measured points (benchmarks/fit_splitk.py).
