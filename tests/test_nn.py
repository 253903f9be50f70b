"""EschaLinear: numerics against nn.Linear / the dequantized weight, buffers, moves and errors."""
import pytest
import torch
from torch import nn

import escha
from escha.format import random_qweight
from escha.nn import EschaLinear
from escha.ops import KernelPath, resolve_path


def _ref(x, qw, bias):
    return x.double() @ escha.dequantize(qw).double().T + (0 if bias is None else bias.double())


def _rel_rms(y, want):
    return float((y.double() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def _tolerance(m: int, qw) -> float:
    """Relative error allowed an fp32 output of the path escha.matmul runs for M rows (docs/KERNELS.md):
    the decode kernels' fp16 operands 2 (2**-24 + 2**-11) (tolerance table), e4m3 operands 0.077."""
    path = resolve_path(m, qw)
    if path in (KernelPath.DECODE, KernelPath.DECODE_WGMMA):
        return 2 * (2.0**-24 + 2.0**-11)
    assert path == KernelPath.REFERENCE or path.fp8_operands, path
    return 1e-5 if path == KernelPath.REFERENCE else 0.077


@pytest.mark.parametrize("shape", [(70, 200), (128, 128), (257, 33)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_matches_dequantized_weight(shape, with_bias):
    out_f, in_f = shape
    qw = random_qweight(out_f, in_f, bits=2, seed=3)
    bias = torch.randn(out_f) if with_bias else None
    mod = EschaLinear.from_quantized(qw, bias)
    assert (mod.in_features, mod.out_features) == (in_f, out_f)
    x = torch.randn(2, 5, in_f)
    y = mod(x)
    assert y.shape == (2, 5, out_f) and y.dtype == torch.float32
    # Exactly escha.matmul plus the bias...
    direct = escha.matmul(x, qw) + (0 if bias is None else bias)
    assert torch.equal(y, direct)
    # ...which is x @ W_hat^T to the precision of the path it ran (M = 10: a decode kernel, fp16 operands).
    assert _rel_rms(y, _ref(x, qw, bias)) < _tolerance(10, qw)


def test_from_linear_matches_nn_linear_up_to_quantization():
    torch.manual_seed(0)
    lin = nn.Linear(96, 40)
    mod = EschaLinear.from_linear(lin, bits=3, seed=1, encoder="greedy")
    assert torch.equal(mod.bias, lin.bias.detach())
    x = torch.randn(64, 96)
    y = mod(x)
    # Exactly the dequantized weight plus the original bias...
    want = x.double() @ mod.dequantized_weight().double().T + lin.bias.detach().double()
    assert _rel_rms(y, want) < _tolerance(64, mod.qweight)
    # ...and close to nn.Linear: a K=3 trellis keeps the output error well below the signal.
    ref = lin(x).detach()
    rel = float((y - ref).pow(2).sum() / (ref - lin.bias.detach()).pow(2).sum())
    assert rel < 0.5
    assert mod.bits == 3 and mod.qweight.bits == 3


def test_buffers_keep_format_dtypes_under_casts():
    mod = EschaLinear.from_quantized(random_qweight(64, 128, 2, seed=0), torch.randn(64))
    mod.to(torch.bfloat16)
    assert mod.scale.dtype == torch.float16 and mod.gscale.dtype == torch.float32
    assert mod.trellis.dtype == torch.int32 and mod.bias.dtype == torch.bfloat16
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert mod(x).dtype == torch.bfloat16
    mod.half()
    assert mod.scale.dtype == torch.float16 and mod.bias.dtype == torch.float16


def test_state_dict_round_trip_through_meta_skeleton():
    src = EschaLinear.from_quantized(random_qweight(48, 160, 3, seed=5), torch.randn(48))
    sd = src.state_dict()
    assert set(sd) == {"bias", "trellis", "su", "sv", "scale", "gscale"}
    with torch.device("meta"):
        dst = EschaLinear(160, 48, bias=True, bits=3)
    dst = dst.to_empty(device="cpu")
    dst.load_state_dict(sd)
    x = torch.randn(4, 160)
    assert torch.equal(dst(x), src(x))


def test_loaded_buffers_refresh_the_cached_weight():
    a = EschaLinear.from_quantized(random_qweight(32, 64, 2, seed=1))
    b = EschaLinear.from_quantized(random_qweight(32, 64, 2, seed=2))
    x = torch.randn(2, 64)
    ya = a(x)
    a.load_state_dict(b.state_dict())  # in-place copies into the same buffers
    assert torch.equal(a(x), b(x)) and not torch.equal(a(x), ya)


def test_errors_are_clear():
    qw = random_qweight(32, 64, 2, seed=0)
    with pytest.raises(ValueError, match="bias must have shape"):
        EschaLinear.from_quantized(qw, torch.zeros(31))
    with pytest.raises(TypeError, match="QuantizedWeight"):
        EschaLinear.from_quantized(torch.zeros(32, 64))
    with pytest.raises(TypeError, match="nn.Linear"):
        EschaLinear.from_linear(nn.Conv1d(3, 3, 1))
    with pytest.raises(ValueError, match="inner dimension"):
        EschaLinear.from_quantized(qw)(torch.randn(2, 63))
    with pytest.raises(ValueError, match="2-D"):
        escha.quantize(torch.randn(4, 8, 8), bits=2)
    with pytest.raises(TypeError, match="bias must be a torch.Tensor \\[32\\] or None, got list"):
        EschaLinear.from_quantized(qw, bias=[0.0] * 32)
    with pytest.raises(TypeError, match="expected a QuantizedWeight, got Tensor"):
        EschaLinear(64, 32).set_qweight(torch.zeros(3))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(bits=2.7), ValueError, r"bits must be one of \(1, 2, 3, 4\), got 2.7"),
    (dict(bits=5), ValueError, "bits must be one of"),
    (dict(in_features=128.5), TypeError, "in_features must be an int, got float"),
    (dict(in_features="128"), TypeError, "in_features must be an int, got str"),
    (dict(out_features=True), TypeError, "out_features must be an int, got bool"),
    (dict(in_features=0), ValueError, "features must be positive"),
    (dict(codebook_id=0.5), TypeError, "codebook_id must be an int, got float"),
    (dict(path="nope"), ValueError, "unknown path 'nope'"),
    (dict(path=["decode"]), TypeError, "path must be None, a KernelPath or one of"),
    (dict(precision="fp4"), ValueError, "unknown precision 'fp4'"),
    (dict(path="reference", precision="fp4"), ValueError, "unknown precision 'fp4'"),  # not hidden by the path
])
def test_constructor_arguments_are_checked(kwargs, error, message):
    args = dict(in_features=128, out_features=64) | kwargs
    with pytest.raises(error, match=message):
        EschaLinear(**args)


def test_constructor_keeps_valid_settings():
    mod = EschaLinear(128, 64, bits=3, path=KernelPath.REFERENCE, precision="bf16")
    assert (mod.in_features, mod.out_features, mod.bits, mod.path, mod.precision) == (128, 64, 3, "reference", "bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reaches_the_input(dtype):
    """An adapter before a frozen quantized layer trains: x gets grad_y @ W_hat, the layer nothing."""
    qw = random_qweight(70, 200, bits=2, seed=4)
    mod = EschaLinear.from_quantized(qw, torch.randn(70)).to(dtype)
    x = torch.randn(3, 4, 200).to(dtype).requires_grad_(True)
    y = mod(x)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    y.backward(g)
    want = g.double().reshape(-1, 70) @ escha.dequantize(qw).double()
    err = float((x.grad.double().reshape(-1, 200) - want).norm() / want.norm())
    assert x.grad.dtype == dtype and err < (1e-5 if dtype == torch.float32 else 2 * 2.0**-8), err
    assert all(p.grad is None for p in mod.parameters()) and not any(b.requires_grad for b in mod.buffers())


def test_set_matmul_path_refuses_an_unknown_path_before_changing_a_module():
    from escha.nn import set_matmul_path
    model = torch.nn.Sequential(EschaLinear.from_quantized(random_qweight(64, 128, bits=2, seed=0)))
    with pytest.raises(ValueError, match="unknown path 'nope'"):
        set_matmul_path(model, "nope")
    assert model[0].path is None
    assert set_matmul_path(model, "reference") == 1 and model[0].path == "reference"
