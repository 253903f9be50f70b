"""gemlite peers (optional): A16W4 and A16W2 integer with group 64, and A16W4 MXFP4.

gemlite's own default autotuning picks its kernel (GEMV, split-K GEMM or GEMM) by M;
the warm-up before graph capture is where it tunes. Activations are fp16, as gemlite's
integer kernels expect.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from .base import Arm, ArmMeta

INT_GROUP = 64
MX_GROUP = 32


def _gemlite_missing() -> str | None:
    try:
        importlib.import_module("gemlite")
        importlib.import_module("gemlite.helper")
    except Exception as e:  # any import failure means the peer cannot run here
        return f"import gemlite failed: {type(e).__name__}: {e}"
    return None


@dataclass
class GemliteState:
    """The gemlite layer plus what the reference needs to rebuild its weights."""

    layer: Any
    w_ref: torch.Tensor  # fp16 dequantized weights [N, K], rebuilt into fp32 by the reference


class _GemliteArm(Arm):
    """What every gemlite arm shares: fp16 activations, the layer's call, a dense reference."""

    def unavailable(self) -> str | None:
        return _gemlite_missing()

    def make_input(self, state: GemliteState, x: torch.Tensor) -> torch.Tensor:
        return x.half()

    def run(self, state: GemliteState, x: torch.Tensor) -> torch.Tensor:
        return state.layer(x)

    def reference(self, state: GemliteState, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ state.w_ref.float().t()


class GemliteInt(_GemliteArm):
    """A16Wn integer weights, asymmetric (W = (q - zero) * scale) with one scale/zero per group."""

    meta = ArmMeta(weight_bits=4.0)

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"gemlite-w{bits}"
        # fp16 scale and zero per group of INT_GROUP weights
        self.meta = ArmMeta(weight_bits=bits + 32.0 / INT_GROUP)

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> GemliteState:
        from gemlite import helper

        if K % INT_GROUP:
            raise ValueError(f"K={K} must be a multiple of {INT_GROUP}")
        levels = 1 << self.bits
        q = torch.randint(0, levels, (N, K), device=device, dtype=torch.uint8)
        scale = (torch.rand(N, K // INT_GROUP, device=device) * 0.02 + 0.01).half()
        zero = torch.full((N, K // INT_GROUP), (levels - 1) / 2, device=device).half()
        w_ref = ((q.view(N, -1, INT_GROUP).float() - zero[..., None].float())
                 * scale[..., None].float()).reshape(N, K).half()
        proc = {4: helper.A16W4_HQQ_INT, 2: helper.A16W2_HQQ_INT}[self.bits]
        layer = proc(device=device).from_weights(q, scale, zero)
        return GemliteState(layer, w_ref)



class GemliteMxfp4(_GemliteArm):
    """A16W4 MXFP4: e2m1 weights with an e8m0 scale per 32, quantized by gemlite's own quantizer."""

    name = "gemlite-mxfp4"
    meta = ArmMeta(weight_bits=4.0 + 8.0 / MX_GROUP)

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> GemliteState:
        from gemlite import helper
        from gemlite.quant_utils import WeightQuantizerMXFP

        w = (torch.randn(N, K, device=device) * K ** -0.5).half()
        quantizer = WeightQuantizerMXFP(compute_dtype=torch.float16, device=str(device))
        q, s = quantizer.quantize_mxfp4(w, index=True)
        q, s = q.view(N, K), s.view(N, K // MX_GROUP)
        # gemlite's dequantize broadcasts a [groups, 1] scale over [groups, 32] values.
        w_ref = quantizer.dequantize(q, s.reshape(-1, 1), shape=(N, K), dtype=torch.float16)
        layer = helper.A16W4_MXFP(device=device, dtype=torch.float16).from_weights(q, s)
        return GemliteState(layer, w_ref)

