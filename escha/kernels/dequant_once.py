"""Dequantize-once prefill: decode the weight into a dense scratch once per call, then one library GEMM.

The scratch holds not T but Hn T, the core with the output Hadamard transform already applied
(a [128, 128] x [128, BK] tensor-core product per block while decoding, exact +-1 matrix):

    y = diag(r) Hn (x' T^T) = x' (Hn T)^T * r      (r = g*c*su per output channel)

so the GEMM's output is y itself. The fp8 variant stores e4m3(Hn_pm1 T / 2) and hands r/(2*sqrt(128))
to torch._scaled_mm as the row-wise weight scale, beside the per-token activation scale; the bf16
variant stores bf16(r * Hn T) and uses a plain bf16 matmul. Neither needs a pass over [M, N] after
the GEMM, which a scratch of plain T does (``dequant_core_fp8``: a read and a write of the whole
output for Hn, cheaper than the folded product while M is small against K).

Workspace: one scratch per (device, stream, dtype, Np, Kp), reused by every call and every weight
of that padded shape: Np*Kp bytes for fp8 (+ 4*Np for the scales), 2*Np*Kp for bf16. For
Qwen3-14B at TP=2: gate_up 17408x5120 -> 89.1 MB fp8 / 178.3 MB bf16; down 5120x8704 ->
44.6 MB fp8 / 89.1 MB bf16. Keying on the stream keeps two streams from racing on one buffer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK, TILE
from ..norm import RowNorm
from .actquant import actquant_config, prepare_actquant, run_actquant
from .codec import CodecPath, codec_path, decode_block
from .core_gemm import core_gemm_config, prepare_core_gemm
from .dequant import DequantConfig, dequant_config, prepare_dequantize_core
from .common import (CORE_FP8_SCALE, FP8_DTYPE, HN_FP8_SCALE, INV_SQRT_HAD, Prepared, check_codebook, check_operands,
                     constant_vector, dot_dtype, hadamard_operand, load_hadamard, prepare, round_to,
                     row_scale_block, weight_plans, workspace)
from .transforms import check_norm, prepare_output_dense


@triton.jit
def dequant_hn_kernel(tr_ptr, su_ptr, scale_ptr, gscale_ptr, h_ptr, w_ptr, wscale_ptr, stride_w, Np,
                      KT: tl.constexpr, BITS: tl.constexpr, BK: tl.constexpr, K_PER_PROG: tl.constexpr,
                      OUT_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, USE_PTX: tl.constexpr):
    """Rows [pid_n*128, +128) and k blocks [pid_k*K_PER_PROG, +K_PER_PROG) of the scratch (the
    launcher picks K_PER_PROG dividing Kp/BK, so every block is in bounds)."""
    BN: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # HN_FP8_SCALE * H, loaded once per program (an L2 hit) and reused over K_PER_PROG blocks: the
    # e4m3 scale rides in the +-1 matrix (a power of two: exact), not in a multiply per weight.
    h = load_hadamard(h_ptr)
    rows = pid_n * BN + tl.arange(0, BN)
    r = row_scale_block(scale_ptr, su_ptr, gscale_ptr, rows, rows < Np) * (INV_SQRT_HAD / HN_FP8_SCALE)
    if OUT_FP8:
        if pid_k == 0:
            tl.store(wscale_ptr + rows, r)
    row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + tl.arange(0, BK)[None, :]
    for i in range(K_PER_PROG):
        kb = pid_k * K_PER_PROG + i
        # Row-broadcast decode: each tile row's words are loaded once and expanded over its 16
        # columns in registers (codec.decode_block), not gathered per weight.
        t = decode_block(tr_ptr, pid_n * (BN // 16), kb * (BK // 16), KT, BITS, BN, BK // 16, USE_PTX)
        # fp16 operands (exact: +-1/2 and 3INST values), fp32 accumulation: every partial sum is a
        # multiple of 2**-14 below 2**9, so the product is exact and independent of its order.
        v = tl.dot(h, t.to(DOT_DTYPE))
        ptrs = row_ptrs + kb * BK
        if OUT_FP8:
            tl.store(ptrs, round_to(v, tl.float8e4nv))
        else:
            # (HN_FP8_SCALE * Hn T) * (r / HN_FP8_SCALE) rounds exactly as (Hn T) * r: powers of two.
            tl.store(ptrs, round_to(v * r[:, None], tl.bfloat16))


@dataclass(frozen=True)
class DequantOnceConfig:
    """Launch parameters of the dequant+Hn kernel; ``dequant_once_config`` is the rule."""

    k_per_prog: int  # k blocks per program, at most (the launcher takes the largest divisor of Kp/BK)
    block_k: int
    num_warps: int
    num_stages: int
    codec: CodecPath


def dequant_once_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DequantOnceConfig:
    """The rule (measurements in the note at the end of this file): BK = 64, up to 8 k blocks a
    program, 4 warps, 3 stages, the device's codec path. M does not change the choice."""
    return DequantOnceConfig(k_per_prog=8, block_k=64, num_warps=4, num_stages=3,
                             codec=codec_path(device or qw.device))


def k_per_prog_for(kb_total: int, want: int) -> int:
    """The largest divisor of kb_total that is <= want: whole programs, no masked blocks."""
    return max(d for d in range(1, min(want, kb_total) + 1) if kb_total % d == 0)


def workspace_bytes(np_: int, kp: int, fp8: bool = True) -> int:
    """Bytes of scratch one padded weight shape needs (the cache holds one per key)."""
    return np_ * kp + 4 * np_ if fp8 else 2 * np_ * kp


def scratch(qw: QuantizedWeight, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The workspace a scratch filler writes: (e4m3 [Np, Kp], fp32 scales [Np]) or (bf16 [Np, Kp], None)."""
    np_, kp = qw.padded_shape
    w = workspace(qw.device, FP8_DTYPE if fp8 else torch.bfloat16, (np_, kp))
    return w, workspace(qw.device, torch.float32, (np_,)) if fp8 else None


def dequant_hn(qw: QuantizedWeight, *, fp8: bool = True, config: DequantOnceConfig | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fill the workspace with the dense weight: (e4m3 [Np, Kp], scales [Np]) or (bf16 [Np, Kp], None).

    fp8: true weight (in the x' domain) = w[n].float() * scale[n]. bf16: already scaled by r.
    The returned tensors are the shared workspace: valid until the next call with the same key.
    ``config`` overrides ``dequant_once_config``.
    """
    check_codebook(qw, "dequant_hn")
    return _dequant_hn(qw, fp8, config or dequant_once_config(qw, 1), keep=False)[:2]


def _dequant_hn(qw: QuantizedWeight, fp8: bool, cfg: DequantOnceConfig,
                keep: bool) -> tuple[torch.Tensor, torch.Tensor | None, Prepared | None]:
    """dequant_hn, and with ``keep`` its launch prepared to run again into the workspace of
    another stream (slots ``w_ptr``, ``wscale_ptr``, the latter w itself at bf16)."""
    np_, kp = qw.padded_shape
    dev = qw.device
    w, ws = scratch(qw, fp8)
    kb_total = kp // cfg.block_k
    kpp = k_per_prog_for(kb_total, cfg.k_per_prog)
    grid = (np_ // HAD_BLOCK, kb_total // kpp)
    ddt = dot_dtype(torch.float16)
    h = hadamard_operand(dev, ddt, HN_FP8_SCALE.value)
    args = (qw.trellis, qw.su, qw.scale, qw.gscale, h, w, ws if fp8 else w, w.stride(0), np_)
    settings = dict(KT=kp // TILE, BITS=qw.bits, BK=cfg.block_k, K_PER_PROG=kpp, OUT_FP8=fp8, DOT_DTYPE=ddt,
                    USE_PTX=cfg.codec == CodecPath.PTX, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return w, ws, prepare(dequant_hn_kernel, grid, *args, slots=("w_ptr", "wscale_ptr") if keep else None,
                          weak=("tr_ptr",), **settings)


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


def _plan_key(kind: str, x2d: torch.Tensor, qw: QuantizedWeight, fp8: bool, cfg: object,
              norm: RowNorm | None) -> tuple:
    """What the prepared launches of a dequantize-once call fix: the path, the weight's other
    tensors, M, x's dtype, row stride and 16-byte alignment, the configurations, and whether a
    norm goes into the activation pass (its eps; its weight is a per-call argument)."""
    m = x2d.shape[0]
    return (kind, fp8, cfg, actquant_config(qw, m, x2d.device), id(qw.su), id(qw.sv), id(qw.scale), id(qw.gscale),
            m, x2d.dtype, x2d.stride(0), x2d.data_ptr() % 16 == 0, None if norm is None else norm.eps)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(1) == 1 else x2d.contiguous()


def _dequant_once(x: torch.Tensor, qw: QuantizedWeight, fp8: bool, config: DequantOnceConfig | None,
                  op: str, norm: RowNorm | None = None) -> torch.Tensor:
    """y = x @ W_hat^T (norm(x) with ``norm``) through the dense scratch (fp8 or bf16 GEMM), in x's dtype.

    The first call of a key (``_plan_key``) launches through Triton and keeps the launches
    prepared (``common.Prepared``, in ``common.weight_plans``); later calls launch them again.
    """
    check_operands(x, qw, op)
    check_codebook(qw, op)
    x2d = _unit_stride_rows(x)
    check_norm(x2d, norm, op)
    cfg = config or dequant_once_config(qw, x2d.shape[0], x.device)
    plans = weight_plans(qw)
    key = _plan_key("hn", x2d, qw, fp8, cfg, norm)
    plan = plans.get(key)
    if plan is not None and x2d.shape[0] > 0:
        p_w, p_act = plan
        w, ws = scratch(qw, fp8)
        p_w.run(w, ws if fp8 else w)
        xq, xscale = run_actquant(x2d, qw, fp8, p_act, norm)
    else:
        w, ws, p_w = _dequant_hn(qw, fp8, cfg, keep=True)
        xq, xscale, p_act = prepare_actquant(x2d, qw, fp8, None, keep=True, norm=norm)
        if p_w is not None and p_act is not None:
            plans[key] = (p_w, p_act)
    y = scaled_mm_rowwise(xq, w.t(), xscale, ws) if fp8 else xq @ w.t()
    if y.shape[1] != qw.out_features:
        y = y[:, :qw.out_features]
    # A fresh tensor in x's dtype (the scratch is never returned): .to copies when needed.
    y = y.to(x.dtype).contiguous() if y.dtype != x.dtype or not y.is_contiguous() else y
    return y.reshape(*x.shape[:-1], qw.out_features)


def dequant_fp8(x: torch.Tensor, qw: QuantizedWeight, *, config: DequantOnceConfig | None = None,
                norm: RowNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T in x's dtype: the weight dequantized once to an e4m3
    scratch (with Hn applied), then one fp8 GEMM with row-wise scales. ``config`` overrides
    ``dequant_once_config``; ``norm`` (``RowNorm.fusable``) applies the RMSNorm before the layer
    in the activation pass."""
    return _dequant_once(x, qw, True, config, "dequant_fp8", norm)


def dequant_bf16(x: torch.Tensor, qw: QuantizedWeight, *, config: DequantOnceConfig | None = None,
                 norm: RowNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T in x's dtype: the weight dequantized once to a bf16
    scratch (r * Hn T), then one bf16 GEMM (the accuracy-first path). ``config`` overrides
    ``dequant_once_config``; ``norm`` as in ``dequant_fp8``."""
    return _dequant_once(x, qw, False, config, "dequant_bf16", norm)

def _dequant_core(x: torch.Tensor, qw: QuantizedWeight, fp8: bool, config: DequantConfig | None,
                  op: str, norm: RowNorm | None = None) -> torch.Tensor:
    """y = x @ W_hat^T (norm(x) with ``norm``) through a scratch of the plain core T, the GEMM
    z = x' T^T, then Hn and the row scales in one pass over z. Launches kept per key as in
    ``_dequant_once``."""
    check_operands(x, qw, op)
    check_codebook(qw, op)
    x2d = _unit_stride_rows(x)
    check_norm(x2d, norm, op)
    m = x2d.shape[0]
    np_, kp = qw.padded_shape
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    cfg = config or dequant_config(qw, x.device)
    gemm_cfg = core_gemm_config(qw, m, x.device) if fp8 else None
    plans = weight_plans(qw)
    key = _plan_key("core", x2d, qw, fp8, (cfg, gemm_cfg), norm)
    plan = plans.get(key)
    t = workspace(qw.device, dtype, (np_, kp))
    if plan is not None and m > 0:
        p_t, p_act, p_out = plan
        p_t.run(t)
        xq, xscale = run_actquant(x2d, qw, fp8, p_act, norm)
    else:
        t, _, p_t = prepare_dequantize_core(qw, dtype, cfg, t, keep=True)
        xq, xscale, p_act = prepare_actquant(x2d, qw, fp8, None, keep=True, norm=norm)
        p_out = None
    y = torch.empty((m, qw.out_features), dtype=x.dtype, device=x.device)
    if gemm_cfg is not None:
        # From core_gemm.MIN_M tokens: one GEMM with Hn and the scales in its epilogue (no z).
        if p_out is not None:
            p_out.run(xq, xscale, t, y)
        else:
            p_out = prepare_core_gemm(xq, xscale, t, qw, y, gemm_cfg, keep=True)
    else:
        t_scale = 1.0 / CORE_FP8_SCALE.value if fp8 else 1.0
        z = scaled_mm_rowwise(xq, t.t(), xscale, constant_vector(x.device, np_, t_scale)) if fp8 else xq @ t.t()
        if p_out is not None:
            p_out.run(z, y)
        else:
            p_out = prepare_output_dense(z, qw, y, keep=True)
    if plan is None and p_t is not None and p_act is not None and p_out is not None:
        plans[key] = (p_t, p_act, p_out)
    return y.reshape(*x.shape[:-1], qw.out_features)


def dequant_core_fp8(x: torch.Tensor, qw: QuantizedWeight, *, config: DequantConfig | None = None,
                     norm: RowNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T in x's dtype through a scratch of the plain core:
    e4m3(64 T) (``dequantize_core``, no Hadamard product while decoding), one fp8 GEMM
    z = x' T^T with row-wise scales, then Hn and the row scales in one pass over z
    (``transforms.hadamard_output_dense``); from ``core_gemm.MIN_M`` tokens on Hopper one fp8 GEMM
    that applies Hn and the row scales in its epilogue instead (``core_gemm``: z never goes to
    memory). It trades dequant_fp8's 128x128 product per weight block for that pass: cheaper
    for few tokens. ``config`` overrides ``dequant_config`` (``core_gemm_config`` picks the GEMM);
    ``norm`` as in ``dequant_fp8``."""
    return _dequant_core(x, qw, True, config, "dequant_core_fp8", norm)


def dequant_core_bf16(x: torch.Tensor, qw: QuantizedWeight, *, config: DequantConfig | None = None,
                      norm: RowNorm | None = None) -> torch.Tensor:
    """``dequant_core_fp8`` at the bf16 precision: bf16(T) (two bytes a weight, no Hadamard
    product), x' in bf16, one bf16 GEMM z = x' T^T (bf16), then Hn and the row scales in one pass
    over z. Against dequant_bf16 (bf16(r Hn T) while decoding) it rounds once more (z to bf16,
    2**-9). ``config`` overrides ``dequant_config``; ``norm`` as in ``dequant_fp8``."""
    return _dequant_core(x, qw, False, config, "dequant_core_bf16", norm)


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
# 148.8 / 81.4; the previous gather-based kernel 150 / 78. So 4 warps became the default.
# Then the +-1 matrix was loaded instead of built per program (16K entries at ~10 integer ops
# against 64K weights a program) and the e4m3 factor 1/2 moved into it (one FMUL a weight less;
# 816 -> 768 SASS instructions per [128, 64] step offline, 128 registers): 97.1 -> 86.7 us on
# gate_up, 54.1 -> 50.9 on down (M=2048, benchmarks/results/prefill_h200_v3.log). In that run
# 3 stages beat 2 at every point (gate_up 76.6-76.9 us, down 43.1-43.6), and 8 warps, BK=128 and
# 16 k blocks a program were slower, so 3 stages is the rule. That is still 2.8x the codec's
# integer floor (27.8 us for gate_up).
# The plain-core form (dequant_core_fp8) against this folded one (benchmarks/results/prefill_h200_v6):
# a scratch of plain T leaves Hn for a pass over [M, N] (a bf16 read and write of the output), but
# skips the 128x128 product per block: dequantize 40.4 against 76.4 us on gate_up, 21.9 against
# 43.5 on down. The whole plain path is 5-21% faster from 128 to 1024 tokens and 1-4% slower at
# 8192; escha.ops.DispatchRule.dequant_path picks between the two by rows per 128 inputs.
