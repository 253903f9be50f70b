"""The Triton codec functions against the reference codec (CPU interpreter; PTX path on GPU)."""
import pytest
import torch
import triton
import triton.language as tl

from escha.format import codebooks
from escha.kernels import codec, common

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _codec_probe(w0_ptr, w1_ptr, off_ptr, st_ptr, v_ptr, N: tl.constexpr, USE_PTX: tl.constexpr, U64: tl.constexpr):
    i = tl.arange(0, N)
    w0 = tl.load(w0_ptr + i)
    w1 = tl.load(w1_ptr + i)
    off = tl.load(off_ptr + i)
    if USE_PTX:
        s = codec.window16_ptx(w0, w1, off)
        v = codec.threeinst_ptx(s)
    elif U64:
        s = codec.window16(w0, w1, off)
        v = codec.threeinst(s)
    else:
        s = codec.window16_u32(w0, w1, off)
        v = codec.threeinst(s)
    tl.store(st_ptr + i, s.to(tl.int32, bitcast=True))
    tl.store(v_ptr + i, v)


def _ref_window(w0, w1, off):
    v = ((w0.long() & 0xFFFFFFFF) << 32) | (w1.long() & 0xFFFFFFFF)
    return ((v >> (48 - off.long())) & 0xFFFF).int()


def _probe(n, seed, use_ptx=False, u64=False):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    w1 = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    off = torch.arange(n, dtype=torch.int32) % 32
    st = torch.full((n,), -1, dtype=torch.int32, device=DEV)
    v = torch.full((n,), float("nan"), dtype=torch.float16, device=DEV)
    _codec_probe[(1,)](w0.to(DEV), w1.to(DEV), off.to(DEV), st, v, N=n, USE_PTX=use_ptx, U64=u64)
    return w0, w1, off, st.cpu(), v.cpu()


@pytest.mark.parametrize("u64", [False, True])
def test_window_and_value_bit_exact(u64):
    w0, w1, off, st, v = _probe(1024, seed=11 + u64, u64=u64)
    ref_s = _ref_window(w0, w1, off)
    assert torch.equal(st, ref_s)
    assert torch.equal(v.view(torch.int16), codebooks.get(0).values(ref_s).view(torch.int16))


def test_threeinst_every_state():
    """All 65536 states through the Triton codec (window at offset 0 of w0 = s << 16)."""
    s = torch.arange(65536, dtype=torch.int64)
    w0 = torch.where(s >= 32768, (s << 16) - 2**32, s << 16).to(torch.int32).to(DEV)
    w1 = torch.randint(-2**31, 2**31, (65536,), dtype=torch.int64).to(torch.int32).to(DEV)
    off = torch.zeros(65536, dtype=torch.int32, device=DEV)
    st = torch.empty(65536, dtype=torch.int32, device=DEV)
    v = torch.empty(65536, dtype=torch.float16, device=DEV)
    _codec_probe[(1,)](w0, w1, off, st, v, N=65536, USE_PTX=False, U64=False)
    ref = codebooks.get(0).values(s)
    assert torch.equal(v.cpu().view(torch.int16), ref.view(torch.int16))
    assert float(ref.abs().max()) == pytest.approx(common.THREEINST_ABSMAX, abs=1e-4)


@triton.jit
def _round_probe(x_ptr, o_ptr, n, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, common.round_to(tl.load(x_ptr + i, mask=i < n), o_ptr.dtype.element_ty), mask=i < n)


ROUND_DTYPES = [torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", ROUND_DTYPES)
def test_rounding_helpers_match_torch(dtype):
    """round_to: integer arithmetic under the interpreter, the hardware conversion on a GPU."""
    _check_round_to(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ROUND_DTYPES)
def test_hardware_rounding_matches_torch_gpu(dtype):
    """The compiled round_to (cvt.rn) on the GPU, in the gpu-marked run too."""
    _check_round_to(dtype)


def _check_round_to(dtype):
    g = torch.Generator().manual_seed(5)
    if dtype == torch.float8_e4m3fn:
        x = torch.cat([torch.randn(4000, generator=g) * 60, torch.randn(4000, generator=g) * 0.01,
                       (torch.rand(192, generator=g) - 0.5) * 920])
    else:
        u = torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64)
        x = torch.cat([torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32),
                       torch.randn(2000, generator=g) * 1e-5, torch.randn(2000, generator=g) * 7e4,
                       torch.tensor([65504.0, 65519.99, 65520.0, 6.1e-5, 5.96e-8, 2.98e-8, 2.99e-8, 0.0, -0.0,
                                     float("inf"), -float("inf")] + [0.0] * 181)])
    o = torch.empty(x.shape, dtype=dtype, device=DEV)
    _round_probe[(1,)](x.to(DEV), o, x.numel(), N=8192)
    ref = x.to(dtype)
    o = o.cpu()
    nan = torch.isnan(ref.float())
    assert torch.isnan(o[nan].float()).all()
    assert torch.equal(o[~nan].view(torch.uint8), ref[~nan].view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ptx_path_bit_exact_vs_fallback():
    for seed in range(4):
        w0, w1, off, st, v = _probe(4096, seed=100 + seed, use_ptx=True)
        _, _, _, st_f, v_f = _probe(4096, seed=100 + seed, use_ptx=False)
        assert torch.equal(st, st_f)
        assert torch.equal(v.view(torch.int16), v_f.view(torch.int16))
        ref = codebooks.get(0).values(_ref_window(w0, w1, off))
        assert torch.equal(v.view(torch.int16), ref.view(torch.int16))
