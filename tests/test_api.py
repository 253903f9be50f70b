"""The public API on CPU: quantize, dequantize, matmul, QuantizedWeight; and its input errors."""
import pytest
import torch

import escha
from escha.format import matmul_reference, random_qweight


# The API's shape handling is encoder-independent; the greedy encoder keeps these CPU tests fast
# (the exact Viterbi encoder has its own tests in tests/test_viterbi.py and test_quantize.py).
FAST = {"encoder": "greedy"}


@pytest.mark.parametrize("shape", [(16, 32), (37, 53), (128, 256), (1, 1), (130, 7)])
@pytest.mark.parametrize("bits", [2, 3])
def test_quantize_dequantize_shapes(shape, bits):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    qw = escha.quantize(w, bits=bits, **FAST)
    assert isinstance(qw, escha.QuantizedWeight)
    assert qw.shape == shape and qw.bits == bits and qw.codebook.name == "3inst"
    wh = escha.dequantize(qw)
    assert wh.shape == shape and wh.dtype == torch.float32
    rel = float((wh - w).norm() / w.norm())
    # A real approximation: the greedy encoder measures 0.24-0.67 at K=2 and 0.11-0.47 at K=3 on
    # these shapes (zeros would give 1, a wrong sign 2); the Viterbi encoder's own tests bound it tighter.
    assert rel < {2: 0.75, 3: 0.55}[bits]


def test_quantize_is_deterministic_and_seeded():
    w = torch.randn(64, 128)
    a, b = escha.quantize(w, seed=3, **FAST), escha.quantize(w, seed=3, **FAST)
    assert all(torch.equal(x, y) for x, y in zip(a.tensors().values(), b.tensors().values()))
    c = escha.quantize(w, seed=4, **FAST)
    assert not torch.equal(a.su, c.su)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matmul_matches_dense(dtype):
    qw = random_qweight(70, 150, bits=2, seed=5)
    x = torch.randn(2, 3, 150).to(dtype)
    y = escha.matmul(x, qw)
    assert y.shape == (2, 3, 70) and y.dtype == dtype
    ref = x.float() @ escha.dequantize(qw).T
    # Kernel paths round operands to fp16 (fp32 x too) or bf16; see docs/KERNELS.md for the table.
    tol = {torch.float32: 2e-3, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert float((y.float() - ref).norm() / ref.norm()) < tol


def test_transform_domain_reference_equals_dense():
    qw = random_qweight(100, 300, bits=3, seed=2)
    x = torch.randn(5, 300, dtype=torch.float64)
    dense = x.float() @ escha.dequantize(qw).T
    torch.testing.assert_close(matmul_reference(x, qw), dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", [None, "reference", "decode", "prefill", "dequant-fp8", "dequant-core-fp8",
                                  "dequant-bf16", "dequant-core-bf16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_matmul_propagates_nan_like_torch(path, bad):
    """A non-finite activation poisons its own row of y (all of it, as torch.matmul does), only it."""
    qw = random_qweight(32, 40, seed=1)
    x = torch.randn(3, 40, dtype=torch.bfloat16)
    x[1, 7] = bad
    y = escha.matmul(x, qw, path=path)
    dense = x.float() @ escha.dequantize(qw).T
    assert bool((~torch.isfinite(y[1])).all()) and bool((~torch.isfinite(dense[1])).all())
    assert bool(torch.isfinite(y[[0, 2]]).all())


def test_quantized_weight_properties():
    qw = random_qweight(17408, 5120, bits=2)
    assert qw.padded_shape == (17408, 5120)
    assert abs(qw.bits_per_weight - 2.005147) < 1e-6  # FORMAT.md, "Bits per weight"
    assert abs(random_qweight(5120, 8704, bits=2).bits_per_weight - 2.004321) < 1e-6
    assert "3inst" in repr(qw)
    q2 = random_qweight(16, 16).to("cpu")
    assert q2.device.type == "cpu"


def test_bad_weights():
    with pytest.raises(ValueError, match=r"NaN at \[2, 3\]"):
        w = torch.randn(4, 5)
        w[2, 3] = float("nan")
        escha.quantize(w)
    with pytest.raises(ValueError, match=r"Inf at \[0, 1\]"):
        w = torch.randn(4, 5)
        w[0, 1] = float("inf")
        escha.quantize(w)
    with pytest.raises(ValueError, match="2-D"):
        escha.quantize(torch.randn(4))
    with pytest.raises(ValueError, match="empty"):
        escha.quantize(torch.randn(0, 4))
    with pytest.raises(TypeError, match="floating point"):
        escha.quantize(torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="torch.Tensor"):
        escha.quantize([[1.0]])
    with pytest.raises(ValueError, match="bits must be one of"):
        escha.quantize(torch.randn(4, 4), bits=5)
    with pytest.raises(ValueError, match="unknown codebook"):
        escha.quantize(torch.randn(4, 4), codebook="e8p")


def test_all_zero_weight_is_exact():
    qw = escha.quantize(torch.zeros(20, 30))
    assert torch.equal(escha.dequantize(qw), torch.zeros(20, 30))


def test_bad_matmul_inputs():
    qw = random_qweight(32, 40)
    with pytest.raises(ValueError, match="inner dimension 41"):
        escha.matmul(torch.randn(2, 41), qw)
    with pytest.raises(TypeError, match="float64 is not supported"):
        escha.matmul(torch.randn(2, 40, dtype=torch.float64), qw)
    with pytest.raises(TypeError, match="int32 is not supported"):
        escha.matmul(torch.ones(2, 40, dtype=torch.int32), qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        escha.matmul(torch.randn(2, 40), torch.randn(32, 40))
    with pytest.raises(TypeError, match="torch.Tensor"):
        escha.matmul([1.0] * 40, qw)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        escha.dequantize(torch.randn(3, 3))


def test_device_mismatch_is_refused():
    qw = random_qweight(32, 40).to("meta")
    with pytest.raises(ValueError, match="x is on cpu but the weight is on meta"):
        escha.matmul(torch.randn(2, 40), qw)


def test_qweight_constructor_validates():
    qw = random_qweight(32, 40)
    t = qw.tensors()
    with pytest.raises(escha.FormatError, match="trellis must be"):
        escha.QuantizedWeight(t["trellis"][:1], t["su"], t["sv"], t["scale"], t["gscale"], (32, 40), 2)
    with pytest.raises(escha.FormatError, match="one device"):
        escha.QuantizedWeight(t["trellis"], t["su"].to("meta"), t["sv"], t["scale"], t["gscale"],
                              (32, 40), 2)
    for shape in [(32.7, 40), None, (32,), (True, 40), "32"]:  # refused, not truncated
        with pytest.raises(escha.FormatError, match="shape must be two integers"):
            escha.QuantizedWeight(t["trellis"], t["su"], t["sv"], t["scale"], t["gscale"], shape, 2)
    with pytest.raises(escha.FormatError, match="shape must be positive"):
        escha.QuantizedWeight(t["trellis"], t["su"], t["sv"], t["scale"], t["gscale"], (0, 40), 2)
    with pytest.raises(escha.FormatError, match="shape must be two integers"):
        random_qweight(32.5, 40)
