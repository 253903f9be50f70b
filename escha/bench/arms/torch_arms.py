"""cuBLAS through torch: bf16 matmul and fp8 (e4m3, row-wise scales) scaled matmul."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Arm, ArmMeta

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


class TorchBf16(Arm):
    """torch.matmul in bf16: the decode baseline."""

    name = "torch-bf16"
    meta = ArmMeta(weight_bits=16.0)

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> torch.Tensor:
        return (torch.randn(N, K, device=device) * K ** -0.5).to(torch.bfloat16)

    def run(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, state.t())

    def reference(self, state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ state.float().t()


@dataclass
class Fp8Weight:
    """e4m3 weight [N, K] with one fp32 scale per output row, kept [1, N] as _scaled_mm wants."""

    q: torch.Tensor
    scale: torch.Tensor


def quantize_rows_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3: (q [R, C], scale [R, 1] fp32) with t ~ q * scale."""
    scale = (t.float().abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class TorchFp8(Arm):
    """torch._scaled_mm, e4m3 x e4m3 with row-wise scales, bf16 out: the prefill baseline.

    The activation is quantized outside the timed region (make_input), so this times the
    GEMM alone, as a W8A8 layer whose activation quantization is fused upstream would.
    """

    name = "torch-fp8"
    meta = ArmMeta(weight_bits=8.0, act_bytes=1)

    def weight_bits(self, N: int, K: int) -> float:
        return 8.0 + 32.0 / K

    def unavailable(self) -> str | None:
        if not hasattr(torch, "_scaled_mm"):
            return "torch._scaled_mm is not available in this torch"
        return None

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> Fp8Weight:
        w = torch.randn(N, K, device=device) * K ** -0.5
        q, s = quantize_rows_fp8(w)
        return Fp8Weight(q, s.reshape(1, N).contiguous())

    def make_input(self, state: Fp8Weight, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_fp8(x)

    def run(self, state: Fp8Weight, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xq, sx = x
        return torch._scaled_mm(xq, state.q.t(), scale_a=sx, scale_b=state.scale,
                                out_dtype=torch.bfloat16)

    def reference(self, state: Fp8Weight, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xq, sx = x
        w = state.q.float() * state.scale.reshape(-1, 1)
        return (xq.float() * sx) @ w.t()
