"""Dequant kernel: an Escha W2 weight's trellis words -> the dense core T [Np, Kp].

T is what ``escha.format.decode_trellis`` returns (fp16, exact 3INST values). The kernel writes it
as fp16 (bit-exact), bf16 (T rounded to nearest-even, as ``T.to(torch.bfloat16)``) or fp8 e4m3
(``(T * 64).to(torch.float8_e4m3fn)``, returned with the dequant multiplier 1/64).

Why 64: the largest |3INST value| over all 65536 states is 3.9727 (checked by the tests), and
64 is the largest power of two with 3.9727 * 64 = 254.3 <= 448 (e4m3's largest finite value). A
power of two makes the scaling itself exact, so the fp8 output differs from T only by e4m3's own
rounding, and multiplying back by 1/64 is exact too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import TILE
from .codec import CodecPath, decode_block, default_codec_path, round_to

#: e4m3 scale: fp8 = T * FP8_SCALE; the dequant multiplier returned is 1 / FP8_SCALE.
FP8_SCALE = 64.0
#: Largest |3INST value| over all states (see the module docstring).
THREEINST_ABSMAX = 3.9727

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@triton.jit
def _dequant_kernel(tr_ptr, out_ptr, KT, stride_on, SCALE: tl.constexpr, BITS: tl.constexpr,
                    BN: tl.constexpr, BKT: tl.constexpr, USE_PTX: tl.constexpr):
    """One program writes T[pid_n*BN : +BN, pid_k*16*BKT : +16*BKT] in out's dtype."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    v = decode_block(tr_ptr, pid_n * (BN // 16), pid_k * BKT, KT, BITS, BN, BKT, USE_PTX)
    rows = pid_n * BN + tl.arange(0, BN)
    cols = pid_k * (16 * BKT) + tl.arange(0, 16 * BKT)
    ptrs = out_ptr + rows[:, None] * stride_on + cols[None, :]
    # fp16 -> fp32 is exact and so is the power-of-two multiply; then exactly one rounding, to
    # nearest-even, written out in integer ops (codec.round_to) so GPU and interpreter agree.
    v = v.to(tl.float32) * SCALE
    tl.store(ptrs, round_to(v, out_ptr.dtype.element_ty))


def dequantize_core(qw: QuantizedWeight, dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None,
                    codec: CodecPath | None = None) -> tuple[torch.Tensor, float]:
    """Decode ``qw``'s trellis into the dense core T [Np, Kp] (transform domain, no signs/scales).

    Args:
        qw: the weight.
        dtype: torch.float16 (exact), torch.bfloat16 (round-to-nearest-even of T) or
            torch.float8_e4m3fn (T * 64, rounded).
        out: optional preallocated workspace [Np, Kp] of ``dtype`` (rows may be strided,
            columns contiguous); it is filled and returned.
        codec: codec instruction path; default PTX on CUDA, Triton otherwise.

    Returns:
        (T_out, scale): T is approximately ``T_out.float() * scale``; scale is 1.0 for fp16/bf16
        and 1/64 for fp8.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    if qw.codebook_id != 0:
        raise ValueError(f"the dequant kernel implements the 3INST codebook only, got {qw.codebook.name}")
    np_, kp = qw.padded_shape
    if out is None:
        out = torch.empty((np_, kp), dtype=dtype, device=qw.device)
    if out.shape != (np_, kp) or out.dtype != dtype or out.device != qw.device or out.stride(1) != 1:
        raise ValueError(f"out must be a {dtype} [{np_}, {kp}] tensor on {qw.device} with contiguous "
                         f"rows, got {out.dtype} {list(out.shape)} stride {out.stride()} on {out.device}")
    path = codec or default_codec_path(qw.device)
    scale = FP8_SCALE if dtype == torch.float8_e4m3fn else 1.0
    kt = kp // TILE
    bn, bkt = 64, 8  # 64x128 outputs per program: whole tiles, and Np, Kp are multiples of 128
    grid = (np_ // bn, kt // bkt)
    _dequant_kernel[grid](qw.trellis, out, kt, out.stride(0), SCALE=scale, BITS=qw.bits, BN=bn, BKT=bkt,
                          USE_PTX=path == CodecPath.PTX, num_warps=4)
    return out, 1.0 / scale
