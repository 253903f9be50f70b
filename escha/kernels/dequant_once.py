"""Dequantize-once prefill: decode the weight into a dense scratch once per call, then one library GEMM.

The scratch holds not T but Hn T, the core with the output Hadamard transform already applied
(a [128, 128] x [128, BK] tensor-core product per block while decoding, exact +-1 matrix):

    y = diag(r) Hn (x' T^T) = x' (Hn T)^T * r      (r = g*c*su per output channel)

so the GEMM's output is y itself. The fp8 variant stores e4m3(Hn_pm1 T / 2) and hands r/(2*sqrt(128))
to torch._scaled_mm as the row-wise weight scale, beside the per-token activation scale; the bf16
variant stores bf16(r * Hn T) and uses a plain bf16 matmul. Neither needs a pass over [M, N] after
the GEMM, which a scratch of plain T would (a read and a write of the whole output for Hn).

Workspace: one scratch per (device, stream, dtype, Np, Kp), reused by every call and every weight
of that padded shape: Np*Kp bytes for fp8 (+ 4*Np for the scales), 2*Np*Kp for bf16. For
Qwen3-14B at TP=2: gate_up 17408x5120 -> 89.1 MB fp8 / 178.3 MB bf16; down 5120x8704 ->
44.6 MB fp8 / 89.1 MB bf16. Keying on the stream keeps two streams from racing on one buffer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.spec import HAD_BLOCK, TILE, words_per_tile
from .actquant import (FP8_DTYPE, _WORKSPACE, actquant, dot_dtype, hadamard_pm1, interpreted,  # noqa: F401
                       to_bf16, to_e4m3, workspace)
from .codec import decode_block

# |Hn_pm1 T| <= 128 * 4 = 512, so halving it keeps every value inside e4m3's 448 with no
# saturation for any trellis bits; typical values (~sqrt(128) * rms(T)) stay far above the
# smallest normal 2**-6. A power of two, so the scaling itself is exact.
W_FP8_SCALE = 0.5
HAD_NORM = 1.0 / math.sqrt(HAD_BLOCK)


@triton.jit
def dequant_hn_kernel(tr_ptr, su_ptr, cscale_ptr, gscale_ptr, w_ptr, wscale_ptr, stride_w,
                      KT: tl.constexpr, KBITS: tl.constexpr, BK: tl.constexpr, K_PER_PROG: tl.constexpr,
                      OUT_FP8: tl.constexpr, W_SCALE: tl.constexpr, NORM: tl.constexpr,
                      ROUND_FIRST: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      USE_PTX: tl.constexpr):
    """Rows [pid_n*128, +128) and k blocks [pid_k*K_PER_PROG, +K_PER_PROG) of the scratch (the
    launcher picks K_PER_PROG dividing Kp/BK, so every block is in bounds)."""
    BN: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = hadamard_pm1(BN, DOT_DTYPE)  # built once per program, reused over K_PER_PROG blocks
    rows = pid_n * BN + tl.arange(0, BN)
    r = (tl.load(cscale_ptr + rows).to(tl.float32) * tl.load(su_ptr + rows).to(tl.float32)
         * tl.load(gscale_ptr) * NORM)
    if OUT_FP8:
        if pid_k == 0:
            tl.store(wscale_ptr + rows, r / W_SCALE)
    row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + tl.arange(0, BK)[None, :]
    for i in range(K_PER_PROG):
        kb = pid_k * K_PER_PROG + i
        # Row-broadcast decode: each tile row's words are loaded once and expanded over its 16
        # columns in registers (codec.decode_block), not gathered per weight.
        t = decode_block(tr_ptr, pid_n * (BN // 16), kb * (BK // 16), KT, KBITS, BN, BK // 16, USE_PTX)
        # fp16 operands (exact: +-1 and 3INST values), fp32 accumulation: every partial sum is a
        # multiple of 2**-13 below 2**10, so the product is exact and independent of its order.
        v = tl.dot(h, t.to(DOT_DTYPE))
        ptrs = row_ptrs + kb * BK
        if OUT_FP8:
            tl.store(ptrs, to_e4m3(v * W_SCALE, ROUND_FIRST))
        else:
            tl.store(ptrs, to_bf16(v * r[:, None], ROUND_FIRST))


@dataclass(frozen=True)
class DequantConfig:
    """k blocks of BK per program (at most; the launcher takes the largest divisor of Kp/BK not
    above it), warps and software-pipeline depth."""

    k_per_prog: int = 8
    block_k: int = 64
    num_warps: int = 4  # 4 beat 8 on the H200: gate_up 97 vs 117 us, down 54 vs 64 us (prefill_h200_v2.log)
    num_stages: int = 2


def k_per_prog_for(kb_total: int, want: int) -> int:
    """The largest divisor of kb_total that is <= want: whole programs, no masked blocks."""
    return max(d for d in range(1, min(want, kb_total) + 1) if kb_total % d == 0)


def workspace_bytes(np_: int, kp: int, fp8: bool = True) -> int:
    """Bytes of scratch one padded weight shape needs (the cache holds one per key)."""
    return np_ * kp + 4 * np_ if fp8 else 2 * np_ * kp


def dequant_hn(trellis: torch.Tensor, su: torch.Tensor, cscale: torch.Tensor, gscale: torch.Tensor,
               bits: int, fp8: bool = True, config: DequantConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fill the workspace with the dense weight: (e4m3 [Np, Kp], scales [Np]) or (bf16 [Np, Kp], None).

    fp8: true weight (in the x' domain) = w[n].float() * scale[n]. bf16: already scaled by r.
    The returned tensors are the shared workspace: valid until the next call with the same key.
    """
    tn, kt, nw = trellis.shape
    if nw != words_per_tile(bits):
        raise ValueError(f"trellis has {nw} words per tile, K={bits} needs {words_per_tile(bits)}")
    cfg = config or DequantConfig()
    np_, kp = tn * TILE, kt * TILE
    dev = trellis.device
    w = workspace(dev, FP8_DTYPE if fp8 else torch.bfloat16, (np_, kp))
    ws = workspace(dev, torch.float32, (np_,)) if fp8 else None
    kb_total = kp // cfg.block_k
    kpp = k_per_prog_for(kb_total, cfg.k_per_prog)
    grid = (np_ // HAD_BLOCK, kb_total // kpp)
    dequant_hn_kernel[grid](trellis, su, cscale, gscale, w, ws if fp8 else w, w.stride(0),
                            KT=kt, KBITS=bits, BK=cfg.block_k, K_PER_PROG=kpp,
                            OUT_FP8=fp8, W_SCALE=W_FP8_SCALE, NORM=HAD_NORM, ROUND_FIRST=interpreted(),
                            USE_PTX=trellis.device.type == "cuda" and not interpreted(),
                            DOT_DTYPE=dot_dtype(torch.float16),
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return w, ws


def scaled_mm_rowwise(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor,
                      scale_b: torch.Tensor) -> torch.Tensor:
    """bf16 (a @ b_t) * scale_a[:, None] * scale_b[None, :] for e4m3 a [M, K] and b_t [K, N].

    On CUDA this is torch._scaled_mm with row-wise scales (its row-wise kernels return bf16).
    Elsewhere (the Triton interpreter's CPU runs) it is emulated exactly in fp32.
    """
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b_t, scale_a=scale_a[:, None], scale_b=scale_b[None, :],
                                out_dtype=torch.bfloat16)
    return ((a.float() @ b_t.float()) * scale_a[:, None] * scale_b[None, :]).to(torch.bfloat16)


def dequant_once_matmul(x2d: torch.Tensor, trellis: torch.Tensor, su: torch.Tensor,
                        sv: torch.Tensor, cscale: torch.Tensor, gscale: torch.Tensor,
                        out_features: int, bits: int, fp8: bool = True) -> torch.Tensor:
    """y [M, out_features] in x2d's dtype through the dense scratch (fp8 or bf16 GEMM)."""
    w, ws = dequant_hn(trellis, su, cscale, gscale, bits, fp8=fp8)
    if fp8:
        xq, sx = actquant(x2d, sv, fp8=True)
        y = scaled_mm_rowwise(xq, w.t(), sx, ws)
    else:
        xb, _ = actquant(x2d, sv, fp8=False)
        y = xb @ w.t()
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    # A fresh tensor in x's dtype (the scratch is never returned): .to copies when needed.
    return y.to(x2d.dtype).contiguous() if y.dtype != x2d.dtype or not y.is_contiguous() else y

# Configuration note. The kernel decodes each weight once, adds a 128x128xBK fp16 product per
# block (256 flops a weight) and writes one byte (fp8) or two (bf16) per weight. The decode is
# codec.decode_block's row-broadcast form: per [128, 64] block, two [128, 4] word loads (one word
# pair per tile row) instead of the previous two [128, BK] per-weight gathers, so the pipeliner
# can stage them (cp.async, LDGSTS in the SASS) in a few KB of shared memory; num_stages=2 is back.
# Defaults BK=64, 4 warps, k_per_prog=8 (512 columns a program: (Np/128) * (Kp/512) programs,
# 1360 for gate_up, 680 for down). Offline sm_90 compile facts (ptxas -v, no GPU run), fp8 store:
#     BK=64,  8 warps, 2 stages:  90 registers, 0 spills, 52 KB smem (2 blocks/SM by registers)
#     BK=64,  4 warps, 2 stages: 161 registers, 0 spills, 52 KB smem
#     BK=128, 8 warps, 2 stages: 156 registers, 0 spills, 72 KB smem (1 block/SM by registers)
#     BK=128, 8 warps, 3 stages: 160 registers, 0 spills, 80 KB smem
# all with HGMMA.64xBKx16.F32 (fp16 wgmma) for Hn and LDGSTS for the words. Measured on the H200
# (benchmarks/results/prefill_h200_v2.log, fp8 store, gate_up / down at M=2048): BK=64 8 warps
# 117.4 / 64.1 us, BK=64 4 warps 97.1 / 54.1, BK=64 8 warps 3 stages 98.7 / 55.5, BK=128 8 warps
# 148.8 / 81.4; the previous gather-based kernel 150 / 78. So 4 warps is the default; it is still
# 3.5x the codec's integer floor (27.8 us for gate_up).
# Why not dequant.py's plain-T kernel: a scratch of T leaves the output Hadamard for a separate
# pass over [M, N] (a bf16 read and write of the whole output); folding Hn into the scratch
# lets the library GEMM's row-wise scale carry r = g*c*su and the GEMM output is y. Its fp8
# scale (x64 on T) is the same convention as the fused kernel's; here the scale is 1/2 on Hn T.
