"""escha.quantize: errors, edge cases, determinism, save/load round trip, real-encoder quality."""
from __future__ import annotations

import pytest
import torch

import escha
from escha.format import dequantize
from escha.quant import quantize
from escha.quant.scale import ScaleSearch, search_ratio


def rel_err(w: torch.Tensor, wh: torch.Tensor) -> float:
    return float((w - wh).norm() / w.norm())


def test_nonfinite_weights_are_named() -> None:
    w = torch.randn(20, 30)
    w[3, 7] = float("nan")
    with pytest.raises(ValueError, match=r"NaN at \[3, 7\]"):
        quantize(w)
    w[3, 7] = float("-inf")
    with pytest.raises(ValueError, match=r"Inf at \[3, 7\]"):
        quantize(w)


@pytest.mark.parametrize("kwargs,error,msg", [
    ({"seed": "a"}, TypeError, "seed must be an integer"),
    ({"seed": 1.5}, TypeError, "seed must be an integer"),
    ({"seed": -1}, ValueError, r"seed must be in \[0, 2\*\*63\)"),
    ({"damp": "x"}, TypeError, "damp must be a number"),
    ({"damp": -1.0}, ValueError, "damp must be positive"),
    ({"damp": float("nan")}, ValueError, "damp must be positive"),
    ({"scale_search": "x"}, TypeError, "scale_search must be a ScaleSearch"),
    ({"progress": "yes"}, TypeError, "progress must be None, True, False or a callable"),
    ({"progress": lambda done: None}, TypeError, "progress must take two arguments"),
    ({"hessian": -torch.eye(30)}, ValueError, r"diagonal entry \[0, 0\] is -1"),
])
def test_bad_arguments_are_named_before_any_work(kwargs, error, msg) -> None:
    with pytest.raises(error, match=msg):
        quantize(torch.randn(20, 30), **kwargs)


@pytest.mark.parametrize("factor", [1e18, 1e-30])
def test_magnitudes_the_scales_cannot_hold_are_refused(factor) -> None:
    """Past 2**50 the encoder's float32 squares overflow (the scale became Inf); below 2**-50 they
    underflow (the weight came back as zeros): W is refused, named, before the encode."""
    with pytest.raises(ValueError, match="largest magnitude .* outside what escha quantizes"):
        quantize(torch.randn(20, 30) * factor)


def test_all_zero_is_exact() -> None:
    qw = quantize(torch.zeros(40, 130), bits=3)
    assert float(qw.gscale) == 0.0
    assert torch.equal(dequantize(qw), torch.zeros(40, 130))


def test_constant_rows() -> None:
    torch.manual_seed(5)
    w = torch.randn(64, 128)
    w[[3, 40]] = torch.tensor([[2.5], [-0.75]])
    w[10] = 0.0
    wh = dequantize(quantize(w, 2, encoder="greedy"))
    assert float(wh[10].abs().max()) < 1e-2 * float(w.abs().max())  # a zero row stays ~zero
    others = [rel_err(w[r], wh[r]) for r in range(64) if r not in (3, 10, 40)]
    typical = sum(others) / len(others)
    for r in (3, 40):  # constant rows are rotated like any other: no worse than a typical row
        assert rel_err(w[r], wh[r]) < 1.5 * typical


def test_deterministic_and_round_trip(tmp_path) -> None:
    torch.manual_seed(6)
    w = torch.randn(96, 140)
    a = quantize(w, 2, seed=11, encoder="greedy")
    b = quantize(w, 2, seed=11, encoder="greedy")
    c = quantize(w, 2, seed=12, encoder="greedy")
    for k, t in a.tensors().items():
        assert torch.equal(t, b.tensors()[k])
    assert not torch.equal(a.su, c.su)
    path = tmp_path / "w.safetensors"
    escha.save_file({"layer": a}, path)
    back = escha.load_file(path)["layer"]
    assert torch.equal(dequantize(back), dequantize(a))


def test_viterbi_quantize_end_to_end() -> None:
    """The default encoder on one small matrix: near the i.i.d. distortion, far below greedy."""
    torch.manual_seed(8)
    w = torch.randn(16, 128)  # one tile row: 8 tiles
    qw = quantize(w, 2, scale_search=None)
    e = rel_err(w, dequantize(qw))
    # sqrt(0.069) = 0.263 for i.i.d. data; greedy gives ~0.65.
    assert 0.2 < e < 0.3
    again = quantize(w, 2, scale_search=None)
    assert torch.equal(qw.trellis, again.trellis)


def test_scale_search_picks_minimum() -> None:
    torch.manual_seed(9)
    table = escha.codebooks.get(0).table().float()
    tiles = torch.randn(2, 256)
    r = search_ratio(tiles, table, 2, ScaleSearch(factors=(0.5, 1.0), sample_tiles=2))
    assert r == pytest.approx(1.0)  # a half-width scale is far worse for Gaussian data
