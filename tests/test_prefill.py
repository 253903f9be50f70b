"""Prefill kernels (activation quantization, fused fp8 GEMM, dequantize-once) against the reference codec.

Runs the Triton kernels under the CPU interpreter (tiny shapes); the same tests run on a GPU.
"""
import os

import torch

if not torch.cuda.is_available():
    # No GPU: run the Triton kernels in the CPU interpreter. Must precede triton's import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from escha.format import block_hadamard, decode_trellis, input_transform, random_qweight, row_scale
from escha.kernels.actquant import FP8_DTYPE, actquant
from escha.kernels.dequant_once import dequant_hn, workspace_bytes
from escha.kernels.prefill import PrefillConfig, prefill_matmul_q

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# e4m3 keeps 3 mantissa bits: round-to-nearest leaves a relative error |d| <= u = 2**-4 per
# element, rms u/sqrt(3) for uniformly spread mantissas (derivation in docs/KERNELS.md, ## Prefill).
U_E4M3 = 2.0 ** -4
FP8_ELEM_RMS = U_E4M3 / 3 ** 0.5  # 0.036: one rounded operand
BF16_ELEM_RMS = 2.0 ** -8 / 3 ** 0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def fp8_round(v: torch.Tensor) -> torch.Tensor:
    return v.to(FP8_DTYPE).float()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_actquant_fp8_matches_transform(dtype):
    g = torch.Generator().manual_seed(11)
    qw = random_qweight(64, 200, 2, seed=3, device=DEV)
    x = torch.randn(37, 200, generator=g).to(DEV, dtype)
    xq, sx = actquant(x, qw.sv, fp8=True)
    assert xq.dtype == FP8_DTYPE and xq.shape == (37, 256) and sx.shape == (37,)
    ref = input_transform(x, qw)
    # Per-token scale: the row's absmax lands on 448 (within rounding of the scale itself).
    amax = xq.float().abs().amax(1)
    assert torch.all(amax >= 400) and torch.all(amax <= 448)
    got = xq.float() * sx[:, None]
    assert rel(got, ref) < 1.3 * FP8_ELEM_RMS
    # And it is exactly the e4m3 rounding of the transformed row (up to ties and 2**-9 of x').
    exact = fp8_round(ref / sx[:, None])
    assert float((exact != xq.float()).float().mean()) < 1e-2


def test_actquant_bf16_and_nan_rows():
    g = torch.Generator().manual_seed(12)
    qw = random_qweight(64, 130, 2, seed=4, device=DEV)
    x = torch.randn(20, 130, generator=g).to(DEV, torch.bfloat16)
    xb, s = actquant(x, qw.sv, fp8=False)
    assert s is None and xb.dtype == torch.bfloat16
    assert rel(xb, input_transform(x, qw)) < 2 * BF16_ELEM_RMS
    x[3, 7] = float("nan")
    x[5, 0] = float("inf")
    _, sx = actquant(x, qw.sv, fp8=True)
    assert torch.isnan(sx[3]) and torch.isnan(sx[5])
    assert torch.isfinite(sx[[0, 1, 2, 4, 6]]).all()


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("m", [5, 130])
def test_fused_prefill_vs_quantized_operands(bits, m):
    """The fused kernel equals x'_q (64 T)_q^T, transformed, in fp32 (given the same fp8 operands)."""
    g = torch.Generator().manual_seed(100 + m + bits)
    qw = random_qweight(200, 256, bits, seed=bits, device=DEV)
    x = torch.randn(m, 256, generator=g).to(DEV, torch.bfloat16)
    xq, sx = actquant(x, qw.sv, fp8=True)
    y = torch.full((m, 200), float("nan"), device=DEV, dtype=torch.float32)  # poisoned
    prefill_matmul_q(xq, sx, qw.trellis, qw.su, qw.scale, qw.gscale, 200, bits, torch.float32,
                     config=PrefillConfig(block_m=64, num_warps=4, num_stages=1), out=y)
    assert torch.isfinite(y).all(), "some outputs were never written"
    t8 = fp8_round(decode_trellis(qw).float() * 64) / 64
    z = (xq.float() * sx[:, None]) @ t8.T
    want = (block_hadamard(z, dim=-1) * row_scale(qw))[:, :200]
    # bf16 epilogue on the GPU: the accumulator is rounded once to bf16 before the Hadamard.
    assert rel(y, want) < (3 * BF16_ELEM_RMS if DEV == "cuda" else 1e-5)


def test_dequant_hn_both_precisions():
    qw = random_qweight(250, 300, 2, seed=9, device=DEV)
    t = decode_trellis(qw).float()
    hn_t = block_hadamard(t, dim=0)  # Hn T (normalized)
    w, ws = dequant_hn(qw.trellis, qw.su, qw.scale, qw.gscale, 2, fp8=True)
    assert w.dtype == FP8_DTYPE and w.shape == (256, 384) and ws.shape == (256,)
    assert rel(w.float() * ws[:, None], hn_t * row_scale(qw)[:, None]) < 1.3 * FP8_ELEM_RMS
    wb, none = dequant_hn(qw.trellis, qw.su, qw.scale, qw.gscale, 2, fp8=False)
    assert none is None and wb.dtype == torch.bfloat16
    assert rel(wb, hn_t * row_scale(qw)[:, None]) < 2 * BF16_ELEM_RMS
    assert workspace_bytes(17408, 5120) == 17408 * 5120 + 4 * 17408


def test_dequant_workspace_is_reused():
    qw1 = random_qweight(128, 128, 2, seed=1, device=DEV)
    qw2 = random_qweight(128, 128, 2, seed=2, device=DEV)
    w1, _ = dequant_hn(qw1.trellis, qw1.su, qw1.scale, qw1.gscale, 2, fp8=True)
    p1 = w1.data_ptr()
    w2, _ = dequant_hn(qw2.trellis, qw2.su, qw2.scale, qw2.gscale, 2, fp8=True)
    assert w2.data_ptr() == p1  # no allocation per call
