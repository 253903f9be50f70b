"""LDLQ: block LDL factorisation, Hessian checks, and lower proxy loss on a correlated Hessian."""
from __future__ import annotations

import pytest
import torch

from escha.format import dequantize
from escha.quant import proxy_loss, quantize
from escha.quant.ldlq import block_ldl_upper, check_hessian, incoherent_hessian, ldlq


def correlated_hessian(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n // 4, generator=g) @ torch.randn(n // 4, n, generator=g)
    x = x + 0.3 * torch.randn(4 * n, n, generator=g)
    return x.T @ x / x.shape[0]


def test_block_ldl_reconstructs_hessian() -> None:
    h = correlated_hessian(64, 1).double()
    u = block_ldl_upper(h, 16, damp=0.0)
    assert float(u.tril(-1).abs().max()) < 1e-12
    for k in range(4):
        assert torch.allclose(u[16 * k:16 * k + 16, 16 * k:16 * k + 16], torch.eye(16, dtype=h.dtype))
    d = torch.linalg.solve(u, torch.linalg.solve(u, h).T).T  # U^-1 H U^-T
    mask = torch.block_diag(*[torch.ones(16, 16)] * 4).bool()
    assert d[~mask].abs().max() < 1e-8 * h.abs().max()


def test_incoherent_hessian_matches_the_format() -> None:
    """tr(E H E^T) equals tr(dT H~ dT^T) for E = dT Hk diag(sv) cropped (one output row, r = 1)."""
    torch.manual_seed(2)
    n, kp = 100, 128
    h = correlated_hessian(n, 2).double()
    sv = (torch.randint(0, 2, (kp,)) * 2 - 1).to(torch.int8)
    ht = incoherent_hessian(h, sv, kp)
    dt = torch.randn(3, kp, dtype=torch.float64)
    from escha.format import block_hadamard
    e = (block_hadamard(dt, dim=1) * sv.double())[:, :n]
    assert torch.allclose(((e @ h) * e).sum(), ((dt @ ht) * dt).sum(), rtol=1e-9)


def test_ldlq_feedback_lowers_proxy_with_scalar_quantizer() -> None:
    h = correlated_hessian(128, 3).double()
    w = torch.randn(64, 128, dtype=torch.float64)

    def rnd(cols: torch.Tensor, k: int) -> torch.Tensor:
        return (cols * 2).round() / 2  # a coarse uniform grid

    plain = rnd(w, 0)
    fed = ldlq(w, block_ldl_upper(h, 16), rnd)
    assert proxy_loss(w, fed, h) < 0.7 * proxy_loss(w, plain, h)


def test_quantize_with_hessian_lowers_proxy() -> None:
    torch.manual_seed(4)
    w = torch.randn(128, 128)
    h = correlated_hessian(128, 4)
    plain = dequantize(quantize(w, 2, encoder="greedy"))
    fed = dequantize(quantize(w, 2, hessian=h, encoder="greedy"))
    assert proxy_loss(w, fed, h) < 0.8 * proxy_loss(w, plain, h)


def test_hessian_errors() -> None:
    w = torch.randn(16, 8)
    with pytest.raises(ValueError, match=r"\[in, in\] = \[8, 8\]"):
        quantize(w, hessian=torch.eye(7))
    bad = torch.eye(8)
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize(w, hessian=bad)
    asym = torch.eye(8)
    asym[0, 1] = 0.5
    with pytest.raises(ValueError, match="not symmetric"):
        quantize(w, hessian=asym)
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_hessian([[1.0]], 1)
