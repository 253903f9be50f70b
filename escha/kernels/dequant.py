"""Dequant kernel: an Escha W2 weight's trellis words -> the dense core T [Np, Kp].

T is what ``escha.format.decode_trellis`` returns (fp16, exact 3INST values). The kernel writes it
as fp16 (bit-exact), bf16 (T rounded to nearest-even, as ``T.to(torch.bfloat16)``) or fp8 e4m3
(``(T * 64).to(torch.float8_e4m3fn)``, returned with the dequant multiplier 1/64;
common.CORE_FP8_SCALE says why 64).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import TILE
from .codec import CodecPath, codec_path, decode_block
from .common import CORE_FP8_SCALE, Prepared, check_codebook, prepare, round_to

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
    # nearest even (common.round_to).
    v = v.to(tl.float32) * SCALE
    tl.store(ptrs, round_to(v, out_ptr.dtype.element_ty))


@dataclass(frozen=True)
class DequantConfig:
    """Launch parameters of the dequant kernel; ``dequant_config`` is the rule that picks them."""

    block_n: int  # rows per program (a multiple of 16 dividing 128)
    block_kt: int  # 16-wide k-tiles per program (dividing 8)
    num_warps: int
    codec: CodecPath


def dequant_config(qw: QuantizedWeight, device: torch.device | None = None) -> DequantConfig:
    """The rule: 128 x 128 outputs per program (whole tiles; Np and Kp are multiples of 128),
    4 warps, the device's codec path (codec.codec_path). Measured (H200, e4m3 output,
    benchmarks/results/prefill_h200_v6.log, median over M = 128..2048): 128 x 128 at 4 warps
    40.4-41.8 us on gate_up 17408x5120 and 21.9-22.8 on down 5120x8704; 64 x 128 at 4 warps (the
    previous rule) 43.2-45.3 / 22.3-23.2; 8 warps slower in both shapes."""
    return DequantConfig(block_n=128, block_kt=8, num_warps=4, codec=codec_path(device or qw.device))


def dequantize_core(qw: QuantizedWeight, dtype: torch.dtype = torch.float16, *,
                    config: DequantConfig | None = None,
                    out: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Decode ``qw``'s trellis into the dense core T [Np, Kp] (transform domain, no signs/scales).

    Args:
        qw: the weight.
        dtype: torch.float16 (exact), torch.bfloat16 (round-to-nearest-even of T) or
            torch.float8_e4m3fn (T * 64, rounded).
        config: launch parameters; None means ``dequant_config(qw)``.
        out: optional preallocated workspace [Np, Kp] of ``dtype`` (rows may be strided,
            columns contiguous); it is filled and returned.

    Returns:
        (T_out, scale): T is approximately ``T_out.float() * scale``; scale is 1.0 for fp16/bf16
        and 1/64 for fp8.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if dtype not in _OUT_DTYPES:
        raise TypeError(f"dtype must be one of {_OUT_DTYPES}, got {dtype}")
    check_codebook(qw, "dequantize_core")
    cfg = config or dequant_config(qw)
    np_, kp = qw.padded_shape
    if out is None:
        out = torch.empty((np_, kp), dtype=dtype, device=qw.device)
    if out.shape != (np_, kp) or out.dtype != dtype or out.device != qw.device or out.stride(1) != 1:
        raise ValueError(f"out must be a {dtype} [{np_}, {kp}] tensor on {qw.device} with contiguous "
                         f"rows, got {out.dtype} {list(out.shape)} stride {out.stride()} on {out.device}")
    return prepare_dequantize_core(qw, dtype, cfg, out, keep=False)[:2]


def prepare_dequantize_core(qw: QuantizedWeight, dtype: torch.dtype, cfg: DequantConfig, out: torch.Tensor,
                            keep: bool) -> tuple[torch.Tensor, float, Prepared | None]:
    """``dequantize_core`` into ``out`` (checked by the caller) and, with ``keep``, its launch
    prepared to run again into another buffer of the same layout (slot ``out_ptr``), else None."""
    np_, kp = qw.padded_shape
    scale = CORE_FP8_SCALE.value if dtype == torch.float8_e4m3fn else 1.0
    kt = kp // TILE
    grid = (np_ // cfg.block_n, kt // cfg.block_kt)
    args = (qw.trellis, out, kt, out.stride(0))
    settings = dict(SCALE=scale, BITS=qw.bits, BN=cfg.block_n, BKT=cfg.block_kt, USE_PTX=cfg.codec == CodecPath.PTX,
                    num_warps=cfg.num_warps)
    return out, 1.0 / scale, prepare(_dequant_kernel, grid, *args, slots=("out_ptr",) if keep else None,
                                       weak=("tr_ptr",), **settings)
