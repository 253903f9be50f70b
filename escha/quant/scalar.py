"""Scalar peers of the trellis code, as fake quantization (W -> W_hat in float32).

  rtn          round-to-nearest, asymmetric, ``group`` inputs share an fp16 scale and an fp16
               zero (the group minimum): ``bits + 32 / group`` stored bits per weight.
  mxfp4        OCP MXFP4: e2m1 elements, one e8m0 (power-of-two) scale per 32 inputs: 4.25.
  ldlq_scalar  a GPTQ-style peer: the same grid as ``rtn`` (fixed from W before quantizing, i.e.
               GPTQ's "static groups"), with columns rounded one at a time from left to right
               and each rounding error fed forward through the Hessian by escha's LDLQ
               (escha.quant.ldlq with 1-wide blocks, which is GPTQ's update without act-order).

They exist to compare against: the benchmarks quantize the same Linears with them and report
the same metrics as for escha.
"""
from __future__ import annotations

import torch

from .ldlq import DEFAULT_DAMP, block_ldl_upper, check_hessian, ldlq

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_GROUP = 32


def rtn_bpw(bits: int, group: int = 64) -> float:
    """Stored bits per weight of ``rtn``/``ldlq_scalar``: the codes plus fp16 scale and zero per group."""
    return bits + 32 / group


MXFP4_BPW = 4 + 8 / MX_GROUP


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    out_f, in_f = w.shape
    pad = -in_f % group
    return torch.nn.functional.pad(w.float(), (0, pad)).reshape(out_f, -1, group)


def group_grid(w: torch.Tensor, bits: int, group: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero), each [out, in/group], fp16-representable: value = q * scale + zero, q in [0, 2^bits - 1]."""
    g = _groups(w, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).half().float()
    return scale, lo.half().float()


def _round_to_grid(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((x - zero) / safe).round().clamp(0, 2**bits - 1)
    return q * scale + zero


def rtn(w: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    """Round-to-nearest onto the group grid; float32 [out, in]."""
    out_f, in_f = w.shape
    scale, zero = group_grid(w, bits, group)
    q = _round_to_grid(_groups(w, group), scale[..., None], zero[..., None], bits)
    return q.reshape(out_f, -1)[:, :in_f]


def mxfp4(w: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """MXFP4: shared scale 2^(floor(log2 amax) - 2) per ``group`` inputs, e2m1 elements by nearest value."""
    out_f, in_f = w.shape
    g = _groups(w, group)
    amax = g.abs().amax(-1, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2  # e2m1's largest exponent is 2
    scale = torch.pow(2.0, exp.clamp(-127, 127))
    v = (g / scale).clamp(-6, 6)
    grid = torch.tensor(E2M1, device=w.device)
    idx = (v.abs()[..., None] - grid).abs().argmin(-1)
    return (grid[idx] * v.sign() * scale).reshape(out_f, -1)[:, :in_f]


def ldlq_scalar(w: torch.Tensor, hessian: torch.Tensor, bits: int, group: int = 64,
                damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """GPTQ-style quantization onto the ``rtn`` grid with Hessian feedback; float32 [out, in].

    ``hessian`` is E[x x^T] [in, in] of the layer's inputs, damped like escha's LDLQ. The
    feedback runs in float64 on CPU and float32 elsewhere, as in ``escha.quantize``.
    """
    out_f, in_f = w.shape
    h = check_hessian(hessian, in_f).to(w.device)
    scale, zero = group_grid(w, bits, group)
    u = block_ldl_upper(h, block=1, damp=damp)
    dtype = torch.float64 if w.device.type == "cpu" else torch.float32

    def quantize_column(col: torch.Tensor, k: int) -> torch.Tensor:
        j = k // group
        return _round_to_grid(col, scale[:, j:j + 1].to(col.dtype), zero[:, j:j + 1].to(col.dtype), bits)

    return ldlq(w.to(dtype), u, quantize_column, block=1).float()
