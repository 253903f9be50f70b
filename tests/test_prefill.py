"""Prefill kernels (activation quantization, fused fp8 GEMM, dequantize-once) against the reference codec.

Runs the Triton kernels under the CPU interpreter (tiny shapes); the same tests run on a GPU.
"""
from dataclasses import replace

import pytest
import torch

from escha.format import block_hadamard, decode_trellis, dequantize, input_transform, random_qweight, row_scale
from escha.kernels import actquant, actquant_config, dequant_once_config, prefill, prefill_config
from escha.kernels.actquant import ActQuantConfig
from escha.kernels.common import FP8_DTYPE, workspace
from escha.kernels import dequant_once as dequant_once_module
from escha.kernels.dequant_once import (dequant_core_bf16, dequant_core_fp8, dequant_hn, k_per_prog_for,
                                       workspace_bytes)
from escha.kernels.transforms import hadamard_output_dense

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
    xq, sx = actquant(x, qw, fp8=True)
    assert xq.dtype == FP8_DTYPE and xq.shape == (37, 256) and sx.shape == (37,)
    ref = input_transform(x, qw)
    # Per-token power-of-two scale from the bound |x'| <= sqrt(128) max|x|: nothing above 2**8.
    assert torch.equal(torch.frexp(sx).mantissa, torch.full_like(sx, 0.5))
    amax = xq.float().abs().amax(1)
    assert torch.all(amax <= 256) and torch.all(amax >= 256 / 128 ** 0.5 / 2 / 4)  # typical rows
    got = xq.float() * sx[:, None]
    assert rel(got, ref) < 1.3 * FP8_ELEM_RMS
    # And it is exactly the e4m3 rounding of the transformed row (up to ties and 2**-9 of x').
    exact = fp8_round(ref / sx[:, None])
    assert float((exact != xq.float()).float().mean()) < 1e-2


def test_actquant_bf16_and_nan_rows():
    g = torch.Generator().manual_seed(12)
    qw = random_qweight(64, 130, 2, seed=4, device=DEV)
    x = torch.randn(20, 130, generator=g).to(DEV, torch.bfloat16)
    xb, s = actquant(x, qw, fp8=False)
    assert s is None and xb.dtype == torch.bfloat16
    assert rel(xb, input_transform(x, qw)) < 2 * BF16_ELEM_RMS
    x[3, 7] = float("nan")
    x[5, 0] = float("inf")
    xq, sx = actquant(x, qw, fp8=True)
    xf = xq.float()
    assert torch.isnan(xf[3, :128]).all()  # the NaN's Hadamard block
    assert torch.isnan(xf[5]).all()  # a row with an infinity: e4m3 has none
    ok = [0, 1, 2, 4, 6]
    assert torch.isfinite(xf[ok]).all() and torch.isfinite(sx[ok]).all()
    # Through a path the two rows come out NaN and the others finite.
    y = dequant_core_fp8(x, random_qweight(64, 130, 2, seed=5, device=DEV))
    assert torch.isnan(y[[3, 5]]).all() and torch.isfinite(y[ok]).all()


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("m", [5, 130])
def test_fused_prefill_vs_quantized_operands(bits, m):
    """The fused kernel equals x'_q (64 T)_q^T, transformed, in fp32 (given the same fp8 operands)."""
    g = torch.Generator().manual_seed(100 + m + bits)
    qw = random_qweight(200, 256, bits, seed=bits, device=DEV)
    x = torch.randn(m, 256, generator=g).to(DEV, torch.bfloat16)
    xq, sx = actquant(x, qw, fp8=True)  # what prefill computes first (deterministic)
    y = torch.full((m, 200), float("nan"), device=DEV, dtype=torch.float32)  # poisoned
    prefill(x, qw, config=replace(prefill_config(qw, m), block_m=64, num_warps=4, num_stages=1), out=y)
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
    w, ws = dequant_hn(qw, fp8=True)
    assert w.dtype == FP8_DTYPE and w.shape == (256, 384) and ws.shape == (256,)
    assert rel(w.float() * ws[:, None], hn_t * row_scale(qw)[:, None]) < 1.3 * FP8_ELEM_RMS
    wb, none = dequant_hn(qw, fp8=False)
    assert none is None and wb.dtype == torch.bfloat16
    assert rel(wb, hn_t * row_scale(qw)[:, None]) < 2 * BF16_ELEM_RMS
    assert workspace_bytes(17408, 5120) == 17408 * 5120 + 4 * 17408


def test_dequant_workspace_is_reused():
    qw1 = random_qweight(128, 128, 2, seed=1, device=DEV)
    qw2 = random_qweight(128, 128, 2, seed=2, device=DEV)
    w1, _ = dequant_hn(qw1, fp8=True)
    p1 = w1.data_ptr()
    w2, _ = dequant_hn(qw2, fp8=True)
    assert w2.data_ptr() == p1  # no allocation per call


# -- Kernel structure: (row blocks x k blocks) activation grid, row-broadcast dequant -------------

def hadamard_pm1_torch(n: int = 128) -> torch.Tensor:
    """The unnormalized +-1 Sylvester matrix, fp32, built independently of the kernels."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def actquant_reference(x: torch.Tensor, sv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch x -> (e4m3 x', scale) with the kernel's math in fp32: e from the row's max |x|
    (the bound sqrt(128) max|x| lands at or below 2**8), the +-1 Hadamard per 128 block, times
    1/sqrt(128), times 2**e, e4m3 round-to-nearest-even; scale = 2**-e."""
    m, k = x.shape
    kp = sv.numel()
    xp = torch.zeros(m, kp)
    xp[:, :k] = x.float().cpu()
    v = (xp * sv.float().cpu()).reshape(m, kp // 128, 128) @ hadamard_pm1_torch()
    amax = xp.abs().amax(1)
    q = torch.tensor(256.0) / (amax * torch.tensor(128 ** 0.5, dtype=torch.float32))
    e = ((q.view(torch.int32) >> 23) & 0xFF) - 127
    e = e.clamp(-64, 64)
    scale = torch.ldexp(torch.ones(m), e.float())
    h = (v.reshape(m, kp) * torch.tensor(1 / 128 ** 0.5, dtype=torch.float32)) * scale[:, None]
    return h.to(FP8_DTYPE), torch.ldexp(torch.ones(m), -e.float())


def exact_grid_x(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 activations on a coarse grid (multiples of 1/4 below 8): every Hadamard sum is exact
    in fp32, so kernel and reference agree bit for bit whatever the summation order."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-32, 33, (m, k), generator=g).float() / 4).to(DEV, torch.bfloat16)


@pytest.mark.parametrize("m,k,blocks,tiles", [(20, 600, 1, 1), (37, 640, 1, 5), (37, 640, 2, 2), (37, 640, 4, 1),
                                              (3, 1280, 2, 5), (3, 1280, 8, 2)])
def test_actquant_equals_torch_reference(m, k, blocks, tiles):
    """Many k blocks (5 or 10), ragged K and M; one tile a program or a run of them, with tile
    counts that do and do not divide a row (the last program's tile past the row is masked)."""
    qw = random_qweight(64, k, 2, seed=5, device=DEV)
    x = exact_grid_x(m, k, seed=m)
    xq, sx = actquant(x, qw, fp8=True, config=ActQuantConfig(blocks=blocks, tiles=tiles))
    q_ref, s_ref = actquant_reference(x, qw.sv)
    kp = qw.padded_shape[1]
    assert xq.shape == (m, kp) and sx.shape == (m,)
    assert torch.equal(sx.cpu(), s_ref)
    assert torch.equal(xq.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("k,want", [(5120, (8, 5)), (8704, (8, 9)), (14336, (16, 7)), (4096, (16, 2)),
                                    (640, (8, 1)), (256, (2, 1)), (100, (1, 1))])
def test_actquant_rule(k, want):
    """Whole rows a program, in tiles of 16 blocks where 16 divides the row, else 8 (fewer for
    short rows), at any M."""
    qw = random_qweight(64, k, 2, seed=1)
    for m in (1, 300, 8192):
        cfg = actquant_config(qw, m)
        assert (cfg.blocks, cfg.tiles) == want


def test_actquant_configs_agree_bitwise():
    """Any launch shape gives the same bits, twice; a bad shape is refused."""
    qw = random_qweight(64, 1000, 2, seed=6, device=DEV)
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    a = actquant(x, qw, fp8=True, config=ActQuantConfig(1, 1))
    xb1, _ = actquant(x, qw, fp8=False, config=ActQuantConfig(1, 1))
    for cfg in (ActQuantConfig(1, 1), ActQuantConfig(2, 3), ActQuantConfig(8, 1), ActQuantConfig(4, 2)):
        b = actquant(x, qw, fp8=True, config=cfg)
        assert torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])
        xb2, _ = actquant(x, qw, fp8=False, config=cfg)
        assert torch.equal(xb1, xb2)
    with pytest.raises(ValueError, match="power of two"):
        ActQuantConfig(3, 1)


def test_dequant_hn_exact_and_poisoned():
    """bf16 scratch: bitwise bf16(r * Hn_pm1 T / sqrt(128)) (Hn_pm1 T is exact in fp32); fp8
    scratch: bitwise e4m3(Hn_pm1 T / 2) wherever that is a normal e4m3 value. The scratch is
    poisoned first (NaN bytes), so a block the kernel skips shows up. Kp = 640: 10 k blocks of 64,
    5 per program (k_per_prog_for(10, 8))."""
    assert k_per_prog_for(10, 8) == 5 and k_per_prog_for(80, 8) == 8 and k_per_prog_for(7, 4) == 1
    qw = random_qweight(250, 600, 2, seed=21, device=DEV)
    t = decode_trellis(qw).float().cpu()
    hn = (hadamard_pm1_torch() @ t.reshape(2, 128, 640)).reshape(256, 640)
    dev = torch.device(DEV)
    workspace(dev, torch.bfloat16, (256, 640)).fill_(float("nan"))
    workspace(dev, FP8_DTYPE, (256, 640)).view(torch.uint8).fill_(0x7F)  # e4m3fn NaN
    r = (qw.scale.float() * qw.su.float() * qw.gscale.float() * (1 / 128 ** 0.5)).cpu()
    wb, _ = dequant_hn(qw, fp8=False)
    assert torch.equal(wb.cpu(), (hn * r[:, None]).to(torch.bfloat16))
    base = dequant_once_config(qw, 1)
    w8, ws = dequant_hn(qw, fp8=True, config=replace(base, k_per_prog=8, block_k=64))
    w8, ws = w8.clone(), ws.clone()  # the next call refills the same scratch
    assert not torch.isnan(w8.float()).any()
    want = (hn * 0.5).to(FP8_DTYPE).float()
    normal = (hn * 0.5).abs() >= 2.0 ** -6
    assert torch.equal(w8.cpu().float()[normal], want[normal])
    assert float((w8.cpu().float() - want).abs().max()) <= 2.0 ** -9  # subnormals: within half their step
    assert torch.equal(ws.cpu(), r / 0.5)
    workspace(dev, FP8_DTYPE, (256, 640)).view(torch.uint8).fill_(0x7F)  # poisoned again for the second config
    w8b, _ = dequant_hn(qw, fp8=True, config=replace(base, k_per_prog=1, block_k=128))
    assert torch.equal(w8b.view(torch.uint8), w8.view(torch.uint8))  # same scratch, same bits



@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_hadamard_output_dense_exact(out_dtype):
    """(z H_pm1) is exact in fp32 for bf16 z with few significant bits (every partial sum fits
    24 bits), so the kernel's output equals the fp64 reference rounded once to out's dtype.
    The output is poisoned; rows 70 and 71 of a 72-row z cross the 64-row program boundary and
    the 250 cropped columns the last 128-block."""
    qw = random_qweight(250, 128, 2, seed=31, device=DEV)
    g = torch.Generator().manual_seed(31)
    z = (torch.randint(-64, 65, (72, 256), generator=g).double() / 16).to(DEV, torch.bfloat16)
    out = torch.full((72, 250), float("nan"), device=DEV, dtype=out_dtype)
    hadamard_output_dense(z, qw, out)
    h = hadamard_pm1_torch().double()
    want = (z.double().cpu().reshape(72, 2, 128) @ h).reshape(72, 256)[:, :250]
    r = (qw.scale.double() * qw.su.double() * qw.gscale.double()).cpu()[:250]
    want = want * (r.float().double() * (1 / 128 ** 0.5))  # the kernel's fp32 row scale
    assert torch.isfinite(out).all(), "some outputs were never written"
    assert rel(out.cpu(), want.float()) < (2 * BF16_ELEM_RMS if out_dtype == torch.bfloat16 else 1e-6)
    with pytest.raises(ValueError, match="z must be"):
        hadamard_output_dense(z[:, :128], qw, out)


@pytest.mark.parametrize("bits", [2, 3])
@pytest.mark.parametrize("m", [3, 70])
def test_dequant_core_fp8_vs_quantized_operands(bits, m):
    """The plain-core path equals Hn (x'_q (64 T)_q^T / 64) * r, given the same fp8 operands, up to
    the bf16 rounding of the GEMM's output z (2**-9) and of y; and W_hat within the e4m3 table."""
    g = torch.Generator().manual_seed(200 + m + bits)
    qw = random_qweight(200, 300, bits, seed=bits + 5, device=DEV)
    x = torch.randn(m, 300, generator=g).to(DEV, torch.bfloat16)
    workspace(torch.device(DEV), FP8_DTYPE, qw.padded_shape).view(torch.uint8).fill_(0x7F)  # NaN scratch
    y = dequant_core_fp8(x, qw)
    assert y.dtype == x.dtype and y.shape == (m, 200) and torch.isfinite(y).all()
    xq, sx = actquant(x, qw, fp8=True)
    t8 = fp8_round(decode_trellis(qw).float() * 64) / 64
    z = (xq.float() * sx[:, None]) @ t8.T
    want = (block_hadamard(z, dim=-1) * row_scale(qw))[:, :200]
    assert rel(y, want) < 3 * BF16_ELEM_RMS
    # Against the exact product: the e4m3 table's bound (1.5 x sqrt(2) x the per-element rms).
    dense = dequantize(qw).float()
    assert rel(y, x.float() @ dense.T) < 1.5 * 2 ** 0.5 * FP8_ELEM_RMS


@pytest.mark.parametrize("bits", [2, 3])
def test_dequant_core_bf16_vs_quantized_operands(bits):
    """The bf16 plain-core path equals Hn (x'_b bf16(T)^T) * r given the same bf16 operands, up to
    the bf16 roundings of z and y; and W_hat within the bf16 table (3 roundings of 2**-9)."""
    g = torch.Generator().manual_seed(300 + bits)
    qw = random_qweight(200, 300, bits, seed=bits + 9, device=DEV)
    x = torch.randn(70, 300, generator=g).to(DEV, torch.bfloat16)
    workspace(torch.device(DEV), torch.bfloat16, qw.padded_shape).fill_(float("nan"))  # poisoned scratch
    y = dequant_core_bf16(x, qw)
    assert y.dtype == x.dtype and y.shape == (70, 200) and torch.isfinite(y).all()
    xb, _ = actquant(x, qw, fp8=False)
    z = xb.float() @ decode_trellis(qw).to(torch.bfloat16).float().T
    want = (block_hadamard(z, dim=-1) * row_scale(qw))[:, :200]
    assert rel(y, want) < 3 * BF16_ELEM_RMS
    dense = dequantize(qw).float()
    assert rel(y, x.float() @ dense.T) < 1.5 * 5 ** 0.5 * BF16_ELEM_RMS


def test_constant_vector_is_made_once_and_read_only_by_its_callers(monkeypatch):
    """The GEMM's per-column scale of dequant_core_fp8 is one cached tensor per (device, n,
    value): no fill kernel and no allocation per call; a call uses it and leaves it as it was."""
    from escha.kernels.common import constant_vector
    qw = random_qweight(200, 300, 2, seed=4, device=DEV)
    n = qw.padded_shape[0]
    v = constant_vector(torch.device(DEV), n, 1 / 64)
    assert v.dtype == torch.float32 and v.shape == (n,) and torch.equal(v, torch.full((n,), 1 / 64, device=DEV))
    assert constant_vector(torch.device(DEV), n, 1 / 64) is v
    assert constant_vector(torch.device(DEV), n + 1, 1 / 64) is not v and constant_vector(torch.device(DEV), n, 1.0) is not v
    seen = []
    real = dequant_once_module.scaled_mm_rowwise
    monkeypatch.setattr(dequant_once_module, "scaled_mm_rowwise",
                        lambda a, b, sa, sb: seen.append(sb) or real(a, b, sa, sb))
    dequant_core_fp8(torch.randn(3, 300, device=DEV, dtype=torch.bfloat16), qw)
    assert len(seen) == 1 and seen[0] is v
    assert torch.equal(v, torch.full((n,), 1 / 64, device=DEV))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_constants_made_inside_a_capture_stay_with_their_graph():
    """A constant first asked for inside CUDA-graph capture is filled only when the graph replays:
    it serves that graph (kept alive for it) and is not handed to callers outside it."""
    from escha.kernels import common
    dev = torch.device("cuda")
    n, value = 4099, 0.375  # a key no other test uses
    out = torch.zeros(n, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(common.constant_vector(dev, n, value))
    eager = common.constant_vector(dev, n, value)
    assert torch.equal(eager, torch.full((n,), value, device=dev))  # not the unfilled captured one
    assert common.constant_vector(dev, n, value) is eager
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full((n,), value, device=dev))
