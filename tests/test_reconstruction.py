"""W's reconstruction (docs/FORMAT.md section 5): the reference is the exact value rounded once to
float32, and a float32 decoder in the spec's order stays within the tolerance derived there."""
import functools

import pytest
import torch

import escha
from escha.format import decode_trellis, dequantize, hadamard_matrix, random_qweight, row_scale
from escha.format.spec import HAD_BLOCK

U = 2.0 ** -24
# Each float32 Hadamard stage is a 128-term dot product with float32 +-1/sqrt(128) entries:
# gamma_129 per stage; two stages, the final product and the reference's own rounding (FORMAT.md).
GAMMA = 129 * U / (1 - 129 * U)
COEF = 2.02 * GAMMA


def exact_w(qw) -> torch.Tensor:
    """W in integer arithmetic: 2**13 T is an integer matrix (3INST values are multiples of 2**-13),
    E = Hn_pm1 (2**13 T) Hk_pm1 is exact in int64, W = r * sv * E / (128 * 2**13), rounded once."""
    np_, kp = qw.padded_shape
    t = (decode_trellis(qw).double() * 2 ** 13).to(torch.int64)
    assert torch.equal(t.double(), decode_trellis(qw).double() * 2 ** 13)
    h = hadamard_matrix(HAD_BLOCK, torch.float64, normalized=False).to(torch.int64)
    blocks = t.reshape(np_ // HAD_BLOCK, HAD_BLOCK, kp // HAD_BLOCK, HAD_BLOCK).permute(0, 2, 1, 3)
    e = (h @ blocks @ h).permute(0, 2, 1, 3).reshape(np_, kp)
    w = e.double() * qw.sv.double()[None, :] * row_scale(qw).double()[:, None] / (HAD_BLOCK * 2 ** 13)
    return w[: qw.out_features, : qw.in_features].float()


def float32_decoder(qw, sequential: bool) -> torch.Tensor:
    """The spec's order in float32: Hk, x sv, Hn, x (g c su), with the float32 +-1/sqrt(128) matrix;
    the dot products summed by the BLAS or one term at a time."""
    np_, kp = qw.padded_shape
    h = hadamard_matrix(HAD_BLOCK, torch.float32)

    def right(x):  # x [rows, n] -> x blockdiag(H): 128-term dot products along the last dim
        xb = x.reshape(x.shape[0], -1, HAD_BLOCK)
        if not sequential:
            return (xb @ h).reshape(x.shape)
        acc = torch.zeros_like(xb)
        for k in range(HAD_BLOCK):
            acc = acc + xb[:, :, k:k + 1] * h[k]
        return acc.reshape(x.shape)

    a = right(decode_trellis(qw).float()) * qw.sv.float()[None, :]
    c = right(a.T.contiguous()).T  # Hn a: H is symmetric
    w = c * row_scale(qw)[:, None]
    return w[: qw.out_features, : qw.in_features]


def tolerance(qw) -> torch.Tensor:
    """COEF * |r_i| * S_ij with S = |Hn| |T| |Hk|: a 128 x 128 block sum of |T| over 128."""
    np_, kp = qw.padded_shape
    t = decode_trellis(qw).double().abs()
    s = t.reshape(np_ // HAD_BLOCK, HAD_BLOCK, kp // HAD_BLOCK, HAD_BLOCK).sum(dim=(1, 3)) / HAD_BLOCK
    s = s.repeat_interleave(HAD_BLOCK, 0).repeat_interleave(HAD_BLOCK, 1)
    return (COEF * row_scale(qw).double().abs()[:, None] * s)[: qw.out_features, : qw.in_features]


@functools.lru_cache(maxsize=1)
def _greedy_k1():
    """A quantized (not random) weight of the shape an independent decoder reported: greedy K=1,
    300 x 520, where the float32 reference of the time was 1.26e-6 off the exact value."""
    w = torch.randn(300, 520, generator=torch.Generator().manual_seed(1))
    return escha.quantize(w, bits=1, seed=0, encoder="greedy")


CASES = {"k1": lambda: random_qweight(70, 150, 1, seed=1), "k2": lambda: random_qweight(200, 300, 2, seed=2),
         "k3": lambda: random_qweight(129, 257, 3, seed=3), "k4": lambda: random_qweight(64, 64, 4, seed=4),
         "greedy_k1_300x520": _greedy_k1}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_exact_rounded_once(case):
    qw = CASES[case]()
    assert torch.equal(dequantize(qw), exact_w(qw))


@pytest.mark.parametrize("case", list(CASES))
def test_float32_decoders_within_the_derived_tolerance(case):
    qw = CASES[case]()
    ref = dequantize(qw).double()
    tol = tolerance(qw)
    for sequential in (False, True):
        err = (float32_decoder(qw, sequential).double() - ref).abs()
        assert bool((err <= tol).all()), f"max err/tol {float((err / tol).max()):.3g}"
    # Not vacuous: a decoder with one input sign wrong is caught.
    wrong = float32_decoder(qw, False).double()
    wrong[:, 0] = -wrong[:, 0]
    assert bool(((wrong - ref).abs() > tol).any())
