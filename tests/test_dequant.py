"""Dequant kernel: bit-exact against the reference codec."""
from dataclasses import replace

import pytest
import torch

from escha.format import decode_trellis, random_qweight
from escha.kernels import CodecPath, dequant_config, dequantize_core
from escha.kernels.common import CORE_FP8_SCALE, FP8_MAX, THREEINST_ABSMAX

FP8_SCALE = CORE_FP8_SCALE.value
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1), (130, 200), (64, 300)]  # padding: neither dimension a multiple of 128 (or of 16)
DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]
CASES = [(bits, shape, dt) for bits in (1, 2, 3, 4) for shape in SHAPES for dt in DTYPES]  # 36 cases


def _expected(qw, dtype):
    t = decode_trellis(qw.to("cpu"))
    if dtype == torch.float8_e4m3fn:
        return (t.float() * FP8_SCALE).to(dtype)
    return t.to(dtype)


@pytest.mark.parametrize("bits,shape,dtype", CASES)
def test_dequant_bit_exact(bits, shape, dtype):
    seed = 1000 * bits + shape[0] + shape[1] + DTYPES.index(dtype)
    qw = random_qweight(*shape, bits=bits, seed=seed, device=DEV)
    np_, kp = qw.padded_shape
    out = torch.full((np_, kp), float("nan"), dtype=torch.float32).to(dtype).to(DEV)  # poisoned
    got, scale = dequantize_core(qw, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert scale == (1.0 / FP8_SCALE if dtype == torch.float8_e4m3fn else 1.0)
    exp = _expected(qw, dtype)
    assert not torch.isnan(got.float()).any()
    assert torch.equal(got.cpu().view(torch.uint8), exp.view(torch.uint8))


def test_fp8_scale_is_documented_power_of_two():
    assert FP8_SCALE == 2.0 ** round(torch.log2(torch.tensor(FP8_SCALE)).item())
    assert THREEINST_ABSMAX * FP8_SCALE <= FP8_MAX.value == 448 < THREEINST_ABSMAX * FP8_SCALE * 2


def test_dequant_rejects_bad_workspace():
    qw = random_qweight(20, 20, bits=2, seed=3, device=DEV)
    with pytest.raises(ValueError):
        dequantize_core(qw, torch.float16, out=torch.empty(128, 64, dtype=torch.float16, device=DEV))
    with pytest.raises(TypeError):
        dequantize_core(qw, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", [2, 3])
def test_dequant_gpu_ptx_vs_triton_full_size(bits):
    qw = random_qweight(5120, 8704, bits=bits, seed=bits, device="cuda")
    for dt in DTYPES:
        a, _ = dequantize_core(qw, dt, config=replace(dequant_config(qw), codec=CodecPath.PTX))
        b, _ = dequantize_core(qw, dt, config=replace(dequant_config(qw), codec=CodecPath.TRITON))
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        # The hardware rounding (common.round_to) gives torch's round-to-nearest-even bits.
        assert torch.equal(a.cpu().view(torch.uint8), _expected(qw, dt).view(torch.uint8))
    assert torch.equal(dequantize_core(qw, torch.float16)[0].view(torch.int16),
                       decode_trellis(qw).view(torch.int16))
