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
from .actquant import FP8_DTYPE, actquant, hadamard_pm1, interpreted, to_bf16, to_e4m3, dot_dtype
from .codec import state_values
from .prefill import trellis_offsets

# |Hn_pm1 T| <= 128 * 4 = 512, so halving it keeps every value inside e4m3's 448 with no
# saturation for any trellis bits; typical values (~sqrt(128) * rms(T)) stay far above the
# smallest normal 2**-6. A power of two, so the scaling itself is exact.
W_FP8_SCALE = 0.5
DQ_BLOCK_K = 128
HAD_NORM = 1.0 / math.sqrt(HAD_BLOCK)


@triton.jit
def dequant_hn_kernel(tr_ptr, su_ptr, cscale_ptr, gscale_ptr, w_ptr, wscale_ptr, stride_w,
                      KT: tl.constexpr, KB_TOTAL: tl.constexpr, KBITS: tl.constexpr, BK: tl.constexpr, K_PER_PROG: tl.constexpr,
                      OUT_FP8: tl.constexpr, W_SCALE: tl.constexpr, NORM: tl.constexpr,
                      ROUND_FIRST: tl.constexpr, DOT_DTYPE: tl.constexpr,
                      USE_PTX: tl.constexpr):
    """Rows [pid_n*128, +128) and k blocks [pid_k*K_PER_PROG, +K_PER_PROG) of the scratch."""
    BN: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    W: tl.constexpr = 8 * KBITS
    h = hadamard_pm1(BN, DOT_DTYPE)  # built once per program, reused over K_PER_PROG blocks
    rows = pid_n * BN + tl.arange(0, BN)
    r = (tl.load(cscale_ptr + rows).to(tl.float32) * tl.load(su_ptr + rows).to(tl.float32)
         * tl.load(gscale_ptr) * NORM)
    if OUT_FP8:
        if pid_k == 0:
            tl.store(wscale_ptr + rows, r / W_SCALE)
    for i in range(K_PER_PROG):
        # Constant trip count; the last program's surplus blocks are masked off (the grid rounds
        # KB_TOTAL up to whole programs).
        kb = pid_k * K_PER_PROG + i
        live = kb < KB_TOTAL
        o0, o1, off = trellis_offsets(pid_n * (BN // 16), kb * (BK // 16), KT, BN, BK, KBITS)
        t = state_values(tl.load(tr_ptr + o0, mask=live, other=0),
                         tl.load(tr_ptr + o1, mask=live, other=0), off, USE_PTX)
        v = tl.dot(h, t.to(DOT_DTYPE))  # fp16 operands, fp32 accumulation: exact products, one fp32 rounding
        cols = kb * BK + tl.arange(0, BK)
        ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + cols[None, :]
        if OUT_FP8:
            tl.store(ptrs, to_e4m3(v * W_SCALE, ROUND_FIRST), mask=live)
        else:
            tl.store(ptrs, to_bf16(v * r[:, None], ROUND_FIRST), mask=live)


@dataclass(frozen=True)
class DequantConfig:
    """k blocks of 128 per program (amortizes building H) and warps."""

    k_per_prog: int = 4
    num_warps: int = 4
    # (num_stages is 1 at launch: pipelining would stage the [128, 128] int32 word gathers in
    # shared memory, 320 KB at the default 3 stages, over the 227 KB limit.)


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
    kb_total = kp // DQ_BLOCK_K
    grid = (np_ // HAD_BLOCK, triton.cdiv(kb_total, cfg.k_per_prog))
    dequant_hn_kernel[grid](trellis, su, cscale, gscale, w, ws if fp8 else w, w.stride(0),
                            KT=kt, KB_TOTAL=kb_total, KBITS=bits, BK=DQ_BLOCK_K, K_PER_PROG=cfg.k_per_prog,
                            OUT_FP8=fp8, W_SCALE=W_FP8_SCALE, NORM=HAD_NORM, ROUND_FIRST=interpreted(),
                            USE_PTX=trellis.device.type == "cuda" and not interpreted(),
                            DOT_DTYPE=dot_dtype(torch.float16),
                            num_warps=cfg.num_warps, num_stages=1)
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
# block (256 flops a weight) and writes one byte (fp8) or two (bf16) per weight. k_per_prog=4
# amortizes building H in registers over 4 blocks and gives (Np/128) * (Kp/512) programs: 1360
# for gate_up, 680 for down. num_stages=1 because pipelining stages the word gathers in shared
# memory (over the limit). Measured on the H200: 150 us for gate_up (89 M weights), 78 us for
# down (44.6 M), 3-5x over the 3INST codec's 27-46 us floor on this GPU; the gathered word loads
# (two per weight) and the missing pipelining are the suspects, unmeasured separately.
# Why not dequant.py's plain-T kernel: a scratch of T leaves the output Hadamard for a separate
# pass over [M, N] (a bf16 read and write of the whole output); folding Hn into the scratch
# lets the library GEMM's row-wise scale carry r = g*c*su and the GEMM output is y. Its fp8
# scale (x64 on T) is the same convention as the fused kernel's; here the scale is 1/2 on Hn T.
