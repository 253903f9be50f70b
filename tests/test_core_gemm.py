"""The plain-core path's fp8 GEMM with Hn in its epilogue (escha/kernels/core_gemm.py).

Against its PyTorch reference bit for bit where every fp32 sum is exact (integer-valued e4m3
operands), against the cuBLAS form of the path (GEMM, then the pass over z) within one bf16
rounding of z, and through ``dequant_core_fp8`` with the rule forced down to a few tokens. Runs
under the CPU interpreter (its persistent grid: ``INTERPRETED_PROGRAMS`` programs walking the
blocks); the same tests run on a GPU, the gpu-marked ones at the rule's token counts.
"""
import pytest
import torch

from escha.format import decode_trellis, dequantize, random_qweight
from escha.kernels import actquant
from escha.kernels import dequant_once as dequant_once_module
from escha.kernels.common import FP8_DTYPE, workspace
from escha.kernels.core_gemm import (MIN_M, RULE_CONFIG, CoreGemmConfig, core_gemm, core_gemm_config,
                                     core_gemm_reference)
from escha.kernels.dequant import dequantize_core
from escha.kernels.dequant_once import dequant_core_fp8
from escha.kernels.transforms import hadamard_output_dense

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ELEM_RMS = 2.0 ** -8 / 3 ** 0.5
FP8_ELEM_RMS = 2.0 ** -4 / 3 ** 0.5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def integer_operands(m: int, qw, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 x' and core holding small integers (every fp32 sum of the GEMM and of the epilogue's
    Hadamard exact), with power-of-two token scales: the kernel and its reference then agree bit
    for bit, whatever order they add in."""
    np_, kp = qw.padded_shape
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-8, 9, (m, kp), generator=g).float().to(FP8_DTYPE).to(DEV)
    t = torch.randint(-8, 9, (np_, kp), generator=g).float().to(FP8_DTYPE).to(DEV)
    xscale = torch.exp2(torch.randint(-6, 3, (m,), generator=g).float()).to(DEV)
    return xq, xscale, t


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,m", [((250, 300), 37), ((128, 128), 1), ((300, 130), 130)])
def test_core_gemm_equals_its_reference(shape, m, out_dtype):
    qw = random_qweight(*shape, 2, seed=m, device=DEV)
    xq, xscale, t = integer_operands(m, qw, seed=m + 1)
    out = torch.full((m, qw.out_features), float("nan"), device=DEV, dtype=out_dtype)  # poisoned
    y = core_gemm(xq, xscale, t, qw, out=out)
    assert y is out
    want = core_gemm_reference(xq, xscale, t, qw, out_dtype)
    assert torch.isfinite(want).all()
    assert torch.equal(y, want), f"{int((y != want).sum())} of {y.numel()} outputs differ"


@pytest.mark.parametrize("cfg", [CoreGemmConfig(64, 64, 4, 2), CoreGemmConfig(16, 32, 4, 1)])
def test_core_gemm_configs_give_the_same_bits(cfg):
    """Other block shapes walk the blocks in another order and split K otherwise: with exact
    sums, the same bits (the rule's blocks of 128 rows hold 130 tokens in two)."""
    qw = random_qweight(260, 256, 3, seed=7, device=DEV)
    xq, xscale, t = integer_operands(130, qw, seed=8)
    a = core_gemm(xq, xscale, t, qw, out=torch.full((130, 260), float("nan"), device=DEV))
    b = core_gemm(xq, xscale, t, qw, out=torch.full((130, 260), float("nan"), device=DEV), config=cfg)
    assert torch.equal(a, b) and torch.isfinite(a).all()


@pytest.mark.parametrize("bits", [2, 3])
def test_core_gemm_against_the_cublas_form(bits):
    """Real operands (the activation pass's x', the decoded core): the path's two forms differ
    by how the accumulator adds before z's bf16 rounding, so by at most one bf16 rounding of z.
    Against the reference: fp32 sums in another order (interpreter, 1e-6); on the GPU the tensor
    core's e4m3 accumulation keeps 13-14 bits a k32 step (docs/KERNELS.md, "The partials' bound"),
    which moves z's bf16 rounding in a share of the outputs: again one bf16 rounding of z."""
    qw = random_qweight(200, 300, bits, seed=bits, device=DEV)
    g = torch.Generator().manual_seed(40 + bits)
    x = torch.randn(70, 300, generator=g).to(DEV, torch.bfloat16)
    xq, xscale = actquant(x, qw, fp8=True)
    t, t_scale = dequantize_core(qw, FP8_DTYPE)
    y = core_gemm(xq, xscale, t, qw, out=torch.full((70, 200), float("nan"), device=DEV))
    z = dequant_once_module.scaled_mm_rowwise(xq, t.t(), xscale, torch.full((t.shape[0],), t_scale, device=DEV))
    want = hadamard_output_dense(z, qw, torch.empty(70, 200, device=DEV))
    assert torch.isfinite(y).all()
    assert rel(y, want) < BF16_ELEM_RMS
    assert rel(y, core_gemm_reference(xq, xscale, t, qw, torch.float32)) < (1e-6 if DEV == "cpu" else BF16_ELEM_RMS)


def force_core_gemm(monkeypatch, cfg: CoreGemmConfig = RULE_CONFIG) -> None:
    """The plain-core path with core_gemm at any M (the rule takes it from MIN_M tokens)."""
    monkeypatch.setattr(dequant_once_module, "core_gemm_config", lambda qw, m, device=None: cfg)


@pytest.mark.parametrize("bits", [2, 3])
def test_dequant_core_fp8_through_core_gemm(monkeypatch, bits):
    """The path with core_gemm: its prepared launch reused on a second call, the same bits as the
    first, the e4m3 table against the exact product, NaN rows kept to their rows."""
    qw = random_qweight(200, 300, bits, seed=bits + 5, device=DEV)
    g = torch.Generator().manual_seed(50 + bits)
    x = torch.randn(70, 300, generator=g).to(DEV, torch.bfloat16)
    workspace(torch.device(DEV), FP8_DTYPE, qw.padded_shape).view(torch.uint8).fill_(0x7F)  # NaN scratch
    served = []
    real = dequant_once_module.prepare_core_gemm
    monkeypatch.setattr(dequant_once_module, "prepare_core_gemm", lambda *a, **k: served.append(1) or real(*a, **k))
    force_core_gemm(monkeypatch)
    y = dequant_core_fp8(x, qw)
    y2 = dequant_core_fp8(x, qw)
    assert len(served) == (2 if DEV == "cpu" else 1)  # a compiled launch is kept and run again
    assert y.dtype == x.dtype and y.shape == (70, 200) and torch.isfinite(y).all() and torch.equal(y, y2)
    xq, xscale = actquant(x, qw, fp8=True)
    t8 = (decode_trellis(qw).float() * 64).to(FP8_DTYPE)
    assert rel(y, core_gemm_reference(xq, xscale, t8.to(DEV), qw, torch.float32)) < BF16_ELEM_RMS
    assert rel(y, x.float() @ dequantize(qw).float().T) < 1.5 * 2 ** 0.5 * FP8_ELEM_RMS
    x[3, 7] = float("nan")
    y3 = dequant_core_fp8(x, qw)
    assert torch.isnan(y3[3]).all() and torch.isfinite(y3[[0, 1, 2, 4, 69]]).all()


def test_rule_and_refusals():
    qw = random_qweight(128, 128, 2, seed=1, device=DEV)
    assert core_gemm_config(qw, MIN_M - 1) is None
    assert core_gemm_config(qw, MIN_M) in (RULE_CONFIG, None)  # None only on a GPU before Hopper
    if DEV == "cpu":
        assert core_gemm_config(qw, MIN_M) == RULE_CONFIG
    xq, xscale, t = integer_operands(5, qw, seed=2)
    out = torch.empty(5, 128, device=DEV)
    with pytest.raises(ValueError, match="xq must be e4m3"):
        core_gemm(xq.float(), xscale, t, qw, out=out)
    with pytest.raises(ValueError, match="xscale must be"):
        core_gemm(xq, xscale[:4], t, qw, out=out)
    with pytest.raises(ValueError, match="t must be"):
        core_gemm(xq, xscale, t[:, :64], qw, out=out)
    with pytest.raises(ValueError, match="out must be"):
        core_gemm(xq, xscale, t, qw, out=torch.empty(5, 127, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        core_gemm(xq, xscale, t, qw, out=torch.empty(5, 128, device=DEV, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape,m", [((17408, 5120), 1024), ((5120, 8704), 1300), ((250, 300), 1031)])
def test_core_gemm_at_the_rule(shape, m):
    """The rule's own configuration at and past MIN_M on the GPU: bit for bit its reference on
    integer operands, and the path within one bf16 rounding of z of its cuBLAS form."""
    qw = random_qweight(*shape, 2, seed=3, device=DEV)
    xq, xscale, t = integer_operands(m, qw, seed=4)
    out = torch.full((m, qw.out_features), float("nan"), device=DEV, dtype=torch.bfloat16)
    assert torch.equal(core_gemm(xq, xscale, t, qw, out=out), core_gemm_reference(xq, xscale, t, qw, torch.bfloat16))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m, shape[1], generator=g).to(DEV, torch.bfloat16)
    y = dequant_core_fp8(x, qw)
    xq, xscale = actquant(x, qw, fp8=True)
    t, t_scale = dequantize_core(qw, FP8_DTYPE)
    z = dequant_once_module.scaled_mm_rowwise(xq, t.t(), xscale, torch.full((t.shape[0],), t_scale, device=DEV))
    want = hadamard_output_dense(z, qw, torch.empty(m, qw.out_features, device=DEV))
    assert torch.isfinite(y).all() and rel(y, want) < 2 * BF16_ELEM_RMS
