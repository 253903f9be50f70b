"""A W4A16 MXFP4 Triton kernel (tl.dot_scaled, e2m1 weights, e8m0 scales per 32) and its arm.

On Hopper tl.dot_scaled has no native MXFP4 path: Triton upcasts the weights to bf16
and runs a bf16 MMA. Some configurations are known to compute wrong results there;
that is what the per-config gate is for.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .base import Arm, ArmMeta

MX_GROUP = 32  # weights per e8m0 scale
E8M0_BIAS = 127
# e2m1 magnitudes by the low three bits of a code; bit 3 is the sign.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Random scales in 2^-7 .. 2^-3 keep outputs O(1) for unit-variance activations.
SCALE_EXP_RANGE = (E8M0_BIAS - 7, E8M0_BIAS - 3)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency, but keep CPU imports alive
    triton = None


if triton is not None:

    @triton.jit
    def _mxfp4_w4a16_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
                            stride_xm, stride_wn, stride_sn, stride_ym,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
        """y[M, N] (bf16) = x[M, K] (bf16) @ dequant(w[N, K/2] e2m1, s[N, K/32] e8m0)^T."""
        pid = tl.program_id(0)
        grid_m = tl.cdiv(M, BLOCK_M)
        grid_n = tl.cdiv(N, BLOCK_N)
        # Grouped launch order: GROUP_M row blocks share each weight column block in L2.
        per_group = GROUP_M * grid_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 32)
        mask_m = offs_m < M
        mask_n = offs_n < N

        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        # Weights are [N, K/2] row-major; dot_scaled wants the rhs as [K/2, N] packed along K.
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_kb[:, None]
        s_ptrs = s_ptr + offs_n[:, None] * stride_sn + offs_ks[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, tl.cdiv(K, BLOCK_K)):
            x = tl.load(x_ptrs, mask=mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0)
            s = tl.load(s_ptrs, mask=mask_n[:, None], other=0)
            acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32

        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Mxfp4Config:
    """One launch configuration of the kernel."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8

    def as_dict(self) -> dict[str, int]:
        """The config as ``Mxfp4Config`` keyword arguments: the form ``configs`` returns and rows report."""
        return dict(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                    num_warps=self.num_warps, num_stages=self.num_stages, group_m=self.group_m)


# Small-M tiles for decode, large tiles for prefill, and the num_warps=8 / num_stages>=2
# family that has been seen to return wrong results on Hopper (kept: the gate decides).
MXFP4_CONFIGS: tuple[Mxfp4Config, ...] = (
    Mxfp4Config(16, 64, 128, 4, 3),
    Mxfp4Config(16, 128, 256, 4, 3),
    Mxfp4Config(64, 128, 128, 4, 3),
    Mxfp4Config(128, 128, 128, 8, 3),
    Mxfp4Config(128, 256, 128, 8, 3),
    Mxfp4Config(128, 128, 256, 8, 2),
)


def mxfp4_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: Mxfp4Config) -> torch.Tensor:
    """y = x @ W^T with W in MXFP4: x bf16 [M, K], w uint8 [N, K/2], s uint8 [N, K/32]."""
    M, K = x.shape
    N = w.shape[0]
    if K % cfg.block_k:
        raise ValueError(f"K={K} is not a multiple of block_k={cfg.block_k}")
    y = torch.empty(M, N, device=x.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _mxfp4_w4a16_kernel[grid](x, w, s, y, M, N, K, x.stride(0), w.stride(0), s.stride(0), y.stride(0),
                              BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                              GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def dequantize_mxfp4(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from packed e2m1 codes [N, K/2] (element 2j in the low nibble) and e8m0 [N, K/32]."""
    codes = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(w.shape[0], -1).long()
    mags = torch.tensor(E2M1_MAGNITUDES, device=w.device)[codes & 0x7]
    vals = torch.where((codes & 0x8) != 0, -mags, mags)
    scale = torch.exp2(s.float() - E8M0_BIAS)
    return (vals.reshape(w.shape[0], -1, MX_GROUP) * scale[..., None]).reshape(w.shape[0], -1)


@dataclass
class Mxfp4Weight:
    """Packed weight, its scales, and the config ``run`` launches with."""

    w: torch.Tensor
    s: torch.Tensor
    config: Mxfp4Config = field(default=MXFP4_CONFIGS[0])


def random_mxfp4(N: int, K: int, device: torch.device | str) -> Mxfp4Weight:
    """Uniformly random e2m1 codes (all 16 are finite) and scales in SCALE_EXP_RANGE."""
    if K % MX_GROUP:
        raise ValueError(f"K={K} must be a multiple of {MX_GROUP} for MXFP4")
    w = torch.randint(0, 256, (N, K // 2), device=device, dtype=torch.uint8)
    lo, hi = SCALE_EXP_RANGE
    s = torch.randint(lo, hi + 1, (N, K // MX_GROUP), device=device, dtype=torch.uint8)
    return Mxfp4Weight(w, s)


class TritonMxfp4(Arm):
    """The Triton MXFP4 W4A16 kernel above, best of its configs."""

    name = "triton-mxfp4"
    meta = ArmMeta(weight_bits=4.0 + 8.0 / MX_GROUP)

    def unavailable(self) -> str | None:
        if triton is None or not hasattr(tl, "dot_scaled"):
            return "this triton has no tl.dot_scaled"
        return None

    def configs(self) -> list[dict[str, Any]]:
        return [c.as_dict() for c in MXFP4_CONFIGS]

    def configure(self, state: Mxfp4Weight, config: dict[str, Any]) -> Mxfp4Weight:
        return replace(state, config=Mxfp4Config(**config))

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> Mxfp4Weight:
        return random_mxfp4(N, K, device)

    def run(self, state: Mxfp4Weight, x: torch.Tensor) -> torch.Tensor:
        return mxfp4_matmul(x, state.w, state.s, state.config)

    def reference(self, state: Mxfp4Weight, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ dequantize_mxfp4(state.w, state.s).t()
