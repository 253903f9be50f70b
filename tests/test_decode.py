"""Decode GEMM: every decode block boundary of M, layouts, poisoned outputs, tolerances, split-K
determinism (all of M = 1..64 under the ``slow`` marker)."""
from dataclasses import replace

import pytest
import torch

from escha.format import dequantize, random_qweight
from escha.kernels import CodecPath, DecodeConfig, decode, decode_config, decode_split_k

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Relative Frobenius-error tolerance by output dtype (docs/KERNELS.md "Tolerance table"):
# 2 * (u_out + u_fp16): one rounding of the output (unit roundoff u_out), one rounding of x' to
# the fp16 operand (2**-11); T is exact in fp16 and fp32 accumulation adds < 1e-5 at these K.
U = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TOL = {dt: 2 * (u + 2.0**-11) for dt, u in U.items()}


def _check(y, x, qw):
    ref = x.reshape(-1, x.shape[-1]).double() @ dequantize(qw).double().T
    yf = y.reshape(-1, qw.out_features).double()
    assert not torch.isnan(yf).any(), "an output element was not written"
    err = ((yf - ref).norm() / ref.norm()).item()
    assert err < TOL[y.dtype], f"relative error {err:.3e} >= {TOL[y.dtype]:.3e}"
    return err


def _x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype).to(DEV)


@pytest.fixture(scope="module")
def small_qw():
    return random_qweight(120, 100, bits=2, seed=7, device=DEV)  # pads to 128 x 128


def _run_m(qw, m):
    """M tokens into a poisoned preallocated output; the dtype cycles with M."""
    dtype = (torch.bfloat16, torch.float16, torch.float32)[m % 3]
    x = _x((m, 100), dtype, seed=m)
    out = torch.full((m, 120), float("nan"), dtype=dtype, device=DEV)  # poisoned
    y = decode(x, qw, out=out)
    assert y.data_ptr() == out.data_ptr() and y.dtype == dtype
    _check(y, x, qw)


# block_m is max(16, next_pow2(M)): each side of every block boundary, and the decode range's ends.
BOUNDARY_M = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64)


def test_block_m_rule_boundaries(small_qw):
    assert [decode_config(small_qw, m).block_m for m in BOUNDARY_M] == [16, 16, 16, 16, 32, 32, 32, 64, 64, 64]


@pytest.mark.parametrize("m", BOUNDARY_M)
def test_block_boundaries(small_qw, m):
    _run_m(small_qw, m)


@pytest.mark.slow
@pytest.mark.parametrize("m", list(range(1, 65)))
def test_every_m(small_qw, m):
    _run_m(small_qw, m)


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_other_bits(bits):
    qw = random_qweight(70, 150, bits=bits, seed=bits, device=DEV)
    x = _x((5, 150), torch.bfloat16, seed=bits)
    _check(decode(x, qw), x, qw)


def test_noncontiguous_and_3d(small_qw):
    base = _x((3, 200, 4), torch.bfloat16, seed=21)
    x = base[:, :100, 1]  # strided rows and columns
    assert not x.is_contiguous()
    _check(decode(x, small_qw), x, small_qw)
    x3 = _x((2, 5, 100), torch.float16, seed=22)
    y3 = decode(x3, small_qw)
    assert y3.shape == (2, 5, 120)
    _check(y3, x3, small_qw)


@pytest.mark.parametrize("split", [2, 4])
def test_split_k_deterministic(split):
    qw = random_qweight(64, 512, bits=2, seed=split, device=DEV)  # 4 k-blocks of 128
    x = _x((9, 512), torch.bfloat16, seed=40 + split)
    cfg = replace(decode_config(qw, 9), split=split, fuse_output=False)
    a = decode(x, qw, config=cfg)
    b = decode(x, qw, config=cfg)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bitwise reproducible
    one = decode(x, qw, config=replace(cfg, split=1, fuse_output=True))
    assert ((a.float() - one.float()).norm() / one.float().norm()).item() < TOL[torch.bfloat16]
    _check(a, x, qw)


def test_config_rule_and_override(small_qw):
    cfg = decode_config(small_qw, 20)
    assert cfg.block_m == 32
    assert cfg.split == decode_split_k(1, 128 // 16)
    if DEV == "cpu":
        assert cfg.codec == CodecPath.TRITON
    custom = DecodeConfig(block_n=64, block_kt=4, block_m=64, split=2, num_warps=4, num_stages=1,
                          codec=cfg.codec, fuse_output=False)
    x = _x((20, 100), torch.bfloat16, seed=3)
    _check(decode(x, small_qw, config=custom), x, small_qw)
    with pytest.raises(ValueError):
        decode(x, small_qw, config=replace(custom, block_m=16))  # block_m < M
    with pytest.raises(ValueError):
        decode_config(small_qw, 65)


def test_split_rule_shape():
    assert decode_split_k(1, 10_000) >= 2  # a lone block splits its k-work
    assert decode_split_k(10_000, 10_000) == 1  # a full grid does not
    for nblk in (40, 68, 136, 272):
        for kt in (272, 320, 544, 1088):
            s = decode_split_k(nblk, kt)
            assert s & (s - 1) == 0 and 1 <= s <= 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(17408, 5120), (5120, 8704)])
@pytest.mark.parametrize("m", [1, 8, 40, 64])
def test_benchmark_shapes_gpu(shape, m):
    qw = random_qweight(*shape, bits=2, seed=m, device="cuda")
    x = _x((m, shape[1]), torch.bfloat16, seed=m)
    y = decode(x, qw)
    _check(y, x, qw)
    y2 = decode(x, qw, config=replace(decode_config(qw, m), codec=CodecPath.TRITON))
    assert torch.equal(y.view(torch.int16), y2.view(torch.int16))  # PTX and Triton codecs agree bitwise
