"""The activation transform of the decode GEMMs (escha.kernels.transforms.hadamard_input) against
its PyTorch reference, escha.format.input_transform (under the Triton interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch

from escha.format import input_transform, random_qweight
from escha.kernels.decode_wgmma import mma_column_order
from escha.kernels.transforms import hadamard_input
from escha.norm import RowNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, qw, norm: RowNorm | None) -> torch.Tensor:
    """x' = Hk (sv * pad(norm(x))) in fp64 from the reference codec (fp32 Hadamard products)."""
    return input_transform(x if norm is None else norm.apply(x), qw).double()


@pytest.mark.parametrize("k", [300, 5120, 8200, 16500])  # one row chunk, one exact, two (8192 at a time), three
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_norm", [False, True])
def test_hadamard_input_against_the_reference(k, dtype, with_norm):
    """x' * 2**e rounds once to fp16 (relative 2**-11 an element, measured normwise here), its
    scale 2**-e is a power of two that keeps |x' * 2**e| <= 2**15, and the MMA column order is a
    permutation of each 128-block."""
    g = torch.Generator().manual_seed(k + 7 * with_norm)
    qw = random_qweight(64, k, 2, seed=k, device=DEV)
    x = (torch.randn(3, k, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None]).to(DEV, dtype)
    norm = RowNorm((torch.rand(k, generator=g) + 0.5).to(DEV, dtype), 1e-6) if with_norm else None
    want = reference(x, qw, norm)
    xq, inv = hadamard_input(x, qw, norm=norm)
    assert xq.dtype == torch.float16 and xq.shape == (3, qw.padded_shape[1]) and inv.shape == (3,)
    e = torch.log2(inv.double())
    assert torch.equal(e, e.round())  # powers of two: the scaling itself is exact
    assert xq.double().abs().max() <= 2.0 ** 15
    got = xq.double() * inv.double()[:, None]
    rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    # fp16 rounding 2**-11 a value; with the norm, the model's own rounding of the normalised x to
    # its dtype (bf16 2**-8) can land the other way where the kernel's fp32 mean square differs
    # from torch's by an ulp, so the bound is the dtype's unit roundoff there.
    tol = 2.0 ** -11 if norm is None or dtype == torch.float32 else (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    assert rel <= 2 * tol, rel
    # The MMA column order stores each 128-block permuted, nothing else.
    xo, invo = hadamard_input(x, qw, mma_order=True, norm=norm)
    assert torch.equal(invo, inv)
    order = mma_column_order(DEV)
    blocks = xq.view(3, -1, 128)
    assert torch.equal(xo.view(3, -1, 128).view(torch.int16), blocks[:, :, order].view(torch.int16))


# ------------------------------------------------------------------ the in-register Hadamard
def test_halves_order_stores_each_value_twice_in_the_halves_codecs_columns():
    """The halves codec's x' (decode_wgmma's HALVES): T column 16 q + 8 a + s of a 128-block at
    MMA columns 128 a + 16 s + 8 (q % 2) + 2 (q // 2) + e of its 256, e = 0, 1 (the two halves of
    one weight take the same x'), with the same scales as the plain order."""
    from escha.kernels.transforms import prepare_input
    g = torch.Generator().manual_seed(3)
    qw = random_qweight(64, 300, 2, seed=1, device=DEV)
    x = torch.randn(3, 300, generator=g).to(DEV, torch.bfloat16)
    plain, inv = hadamard_input(x, qw)
    halves, inv_h, _ = prepare_input(x, qw, halves=True, keep=False)
    assert torch.equal(inv_h, inv) and halves.shape == (3, 2 * qw.padded_shape[1])
    q, a, s, e = torch.meshgrid(*(torch.arange(n) for n in (8, 2, 8, 2)), indexing="ij")
    mma = (128 * a + 16 * s + 8 * (q % 2) + 2 * (q // 2) + e).flatten()
    t_col = (16 * q + 8 * a + s).flatten()
    want = torch.empty(3, halves.shape[1] // 256, 256, dtype=torch.float16, device=DEV)
    want[:, :, mma.to(DEV)] = plain.view(3, -1, 128)[:, :, t_col.to(DEV)]
    assert torch.equal(halves.view(3, -1, 256).view(torch.int16), want.view(torch.int16))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from escha.format import block_hadamard, row_scale  # noqa: E402
from escha.kernels import transforms  # noqa: E402
from escha.kernels.common import hadamard128, row_sum128  # noqa: E402
from escha.kernels.transforms import hadamard_output  # noqa: E402
from escha.norm import HeadNorm  # noqa: E402


@triton.jit
def _hadamard128_rows(x_ptr, y_ptr, R: tl.constexpr):
    offs = tl.program_id(0) * R * 128 + tl.arange(0, R)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(y_ptr + offs, hadamard128(tl.load(x_ptr + offs)))


@triton.jit
def _row_sum128_rows(x_ptr, y_ptr, R: tl.constexpr):
    offs = tl.program_id(0) * R * 128 + tl.arange(0, R)[:, None] * 128 + tl.arange(0, 128)[None, :]
    tl.store(y_ptr + offs, row_sum128(tl.load(x_ptr + offs)))


@pytest.mark.parametrize("rows", [1, 2, 16])
@pytest.mark.parametrize("warps", [1, 4])
def test_row_sum128_is_its_fixed_tree(rows, warps):
    """Every element of a row holds the row's sum by one fixed tree (stage k adds the partner
    across index bit 6 - k, in fp32), bit for bit, for any rows a program and warps; the outputs
    poisoned first."""
    g = torch.Generator().manual_seed(rows * 10 + warps)
    x = torch.randn(2 * rows, 128, generator=g) * torch.logspace(-4, 4, 128)[torch.randperm(128, generator=g)]
    want = x.clone()
    idx = torch.arange(128)
    for bit in range(6, -1, -1):
        want = want + want[:, idx ^ (1 << bit)]
    assert (want == want[:, :1]).all()  # a + b == b + a: every column holds the same sum
    y = torch.full_like(x, float("nan")).to(DEV)
    _row_sum128_rows[(2,)](x.to(DEV), y, R=rows, num_warps=warps)
    assert torch.equal(y.cpu(), want)


def sylvester(n: int) -> torch.Tensor:
    i = torch.arange(n)
    bits = (i[:, None] & i[None, :]).tolist()
    return torch.tensor([[(-1.0) ** bin(v).count("1") for v in row] for row in bits], dtype=torch.float64)


@pytest.mark.parametrize("rows", [1, 2, 4, 16])
def test_hadamard128_against_fp64(rows):
    """Seven butterfly stages, each one fp32 rounding of a partial sum whose magnitude is at most
    the sum of |x| over its inputs: |error| <= 7 * 2**-24 * sum|x| of the row, per output."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2 * rows, 128, generator=g) * torch.logspace(-3, 3, 2 * rows)[:, None]
    x[0, 5] = 1e4  # one outlier
    y = torch.full_like(x, float("nan")).to(DEV)  # poisoned: every output must be written
    _hadamard128_rows[(2,)](x.to(DEV), y, R=rows)
    want = x.double() @ sylvester(128)
    bound = 7 * 2.0 ** -24 * x.double().abs().sum(dim=1, keepdim=True)
    assert ((y.cpu().double() - want).abs() <= bound).all()


@pytest.mark.parametrize("k,ch,with_norm", [(2200, 2, False), (2200, 4, True), (2200, 16, False), (2200, 32, True),
                                             (8300, 32, True)])
def test_input_transform_does_not_depend_on_blocks_per_program(monkeypatch, k, ch, with_norm):
    """Each 128-block goes through the same butterflies whichever program takes it, and every
    program computes its row's scale and norm the same way: the output is the same bits for any
    blocks-per-program (ragged last group included; 8300 inputs: two row chunks, K not a multiple
    of 128)."""
    g = torch.Generator().manual_seed(ch + k)
    qw = random_qweight(64, k, 2, seed=ch, device=DEV)  # 18 or 65 blocks: ragged for 4, 16 and 32
    x = (torch.randn(3, k, generator=g) * torch.logspace(-3, 3, 3)[:, None]).to(DEV, torch.bfloat16)
    norm = RowNorm((torch.rand(k, generator=g) + 0.5).to(DEV, torch.bfloat16), 1e-6) if with_norm else None
    monkeypatch.setattr(transforms, "input_blocks_per_program", lambda m, blocks, parallel: 1)
    one, inv1 = hadamard_input(x, qw, mma_order=True, norm=norm)
    monkeypatch.setattr(transforms, "input_blocks_per_program", lambda m, blocks, parallel: ch)
    many, inv = hadamard_input(x, qw, mma_order=True, norm=norm)
    assert torch.equal(inv, inv1) and torch.equal(many.view(torch.int16), one.view(torch.int16))


def test_input_blocks_per_program_rule():
    """Compiled (parallel programs): the most blocks a program (up to 32) that still give
    INPUT_PROGRAMS programs, at least one; in the CPU interpreter (programs one after another) 16."""
    rule = transforms.input_blocks_per_program
    assert rule(1, 40) == 1
    assert rule(1, 200) == 1  # 200 programs: latency-bound, as many as there are blocks
    assert rule(16, 40) == 4  # 160 programs
    assert rule(64, 40) == 16  # 192 programs
    assert rule(64, 68) == 32  # 192 programs
    assert rule(4096, 68) == 32
    for m in (1, 3, 16, 64, 256):
        for blocks in (40, 68, 112):
            ch = rule(m, blocks)
            assert ch in (1, 2, 4, 8, 16, 32)
            assert ch == 1 or m * -(-blocks // ch) >= transforms.INPUT_PROGRAMS
            assert ch == 32 or m * -(-blocks // (2 * ch)) < transforms.INPUT_PROGRAMS
            assert rule(m, blocks, parallel=False) == 16


@pytest.mark.parametrize("m", [1, 3, 17])  # one token a program, four, sixteen and a ragged block
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hadamard_output_against_the_reference(m, split, dtype):
    """y = crop((Hn sum_s z[s]) * g*c*su * 2**-e): the partials summed in order in fp32, then
    butterflies with at most 7 * 2**-24 * sum|z| of error each (test_hadamard128_against_fp64),
    then two fp32 products: within 2**-20 normwise in fp32; in bf16, the one rounding to bf16
    (2**-8 an element) on top."""
    g = torch.Generator().manual_seed(m * 10 + split)
    qw = random_qweight(300, 256, 2, seed=m + split, device=DEV)  # 3 row blocks, the last ragged
    np_ = qw.padded_shape[0]
    z = torch.randn(split, m, np_, generator=g).to(DEV)
    inv = torch.exp2(torch.randint(-5, 6, (m,), generator=g).float()).to(DEV)
    out = torch.full((m, 300), float("nan"), dtype=dtype, device=DEV)
    hadamard_output(z, qw, inv, out)
    zs = z[0].clone()
    for s in range(1, split):
        zs += z[s]
    want = (block_hadamard(zs.double().cpu(), dim=-1) * row_scale(qw).double().cpu()
            * inv.double().cpu()[:, None])[:, :300]
    got = out.double().cpu()
    rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    assert rel <= (2.0 ** -20 if dtype == torch.float32 else 2.0 ** -8), rel


def test_output_shape_rule():
    """The output transform's rule: the most tokens a program (up to 16, no more than m rounded up
    to a power of two) that still leave OUTPUT_PROGRAMS programs, else one; 4 warps."""
    from escha.kernels.transforms import OUTPUT_PROGRAMS, output_shape
    assert output_shape(1, 17408) == (1, 4) and output_shape(1, 5120) == (1, 4)
    assert output_shape(16, 17408) == (4, 4) and output_shape(16, 5120) == (1, 4)
    assert output_shape(64, 17408) == (16, 4) and output_shape(64, 5120) == (4, 4)
    for m in (1, 2, 3, 8, 13, 16, 33, 64, 100, 128, 1000):
        for np_ in (128, 1024, 4096, 5120, 17408, 32768):
            t, w = output_shape(m, np_)
            programs = np_ // 128 * -(-m // t)
            assert w == 4 and t & (t - 1) == 0 and 1 <= t <= min(16, 1 << (m - 1).bit_length())
            assert t == 1 or programs >= OUTPUT_PROGRAMS
            assert t == min(16, 1 << (m - 1).bit_length()) or np_ // 128 * -(-m // (2 * t)) < OUTPUT_PROGRAMS
            assert output_shape(m, np_, parallel=False) == (min(16, 1 << (m - 1).bit_length()), 4)


@pytest.mark.parametrize("m", [1, 7, 17])
@pytest.mark.parametrize("head", [False, True])
def test_hadamard_output_launch_shapes_give_the_same_bits(m, head):
    """Any launch shape (tokens, warps) a program gives the default shape's bits: a ragged last
    program masks its padded rows, and no element's operations change; with a head norm too (its
    mean square by row_sum128's fixed tree: tl.sum's order moved with the warps on the H200)."""
    g = torch.Generator().manual_seed(m)
    qw = random_qweight(300, 256, 2, seed=m, device=DEV)
    z = torch.randn(3, m, qw.padded_shape[0], generator=g).to(DEV)
    inv = torch.exp2(torch.randint(-5, 6, (m,), generator=g).float()).to(DEV)
    hn = None
    if head:
        hn = HeadNorm((torch.rand(384, generator=g) + 0.5).to(DEV, torch.bfloat16),
                      torch.tensor([1, 1, 0], dtype=torch.int8, device=DEV), 1e-6)  # the ragged block plain
    want = hadamard_output(z, qw, inv, torch.full((m, 300), float("nan"), dtype=torch.bfloat16, device=DEV),
                           head_norm=hn)
    assert torch.isfinite(want).all()
    for shape in [(1, 1), (2, 2), (4, 4), (8, 4), (16, 4)]:
        got = hadamard_output(z, qw, inv, torch.full((m, 300), float("nan"), dtype=torch.bfloat16, device=DEV),
                              shape=shape, head_norm=hn)
        assert torch.equal(got, want), shape
    with pytest.raises(ValueError, match="shape must be"):
        hadamard_output(z, qw, inv, torch.empty(m, 300, dtype=torch.bfloat16, device=DEV), shape=(3, 4))


def test_hadamard_output_reads_only_the_rows_of_out():
    """Partials with more rows than the output (a GEMM's M rounded up: decode_wgmma.partial_rows)
    give the bits of the same partials cropped to the output's rows; the extra rows, poisoned
    with NaN, are never read. Fewer rows than the output are refused."""
    g = torch.Generator().manual_seed(11)
    qw = random_qweight(300, 256, 2, seed=11, device=DEV)
    m, mz = 9, 16
    z = torch.randn(3, mz, qw.padded_shape[0], generator=g).to(DEV)
    z[:, m:] = float("nan")
    inv = torch.exp2(torch.randint(-5, 6, (m,), generator=g).float()).to(DEV)
    want = hadamard_output(z[:, :m].contiguous(), qw, inv, torch.empty(m, 300, dtype=torch.bfloat16, device=DEV))
    got = hadamard_output(z, qw, inv, torch.full((m, 300), float("nan"), dtype=torch.bfloat16, device=DEV))
    assert torch.isfinite(want).all()
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="bad shapes"):
        hadamard_output(z[:, :m - 1].contiguous(), qw, inv, torch.empty(m, 300, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("m", [1, 6, 17])
@pytest.mark.parametrize("head", [False, True])
def test_hadamard_output_paired_words_as_fp32(m, head):
    """bf16 partials packed two tokens a word (decode_fp8's: token 2i low, 2i + 1 high) give the
    bits of the same values handed over as fp32 partials, at every launch shape; the high half of
    the last word past an odd M, poisoned with NaN, goes nowhere. Words of too few rows, or a
    non-unit stride along Np, are refused."""
    g = torch.Generator().manual_seed(m + 100 * head)
    qw = random_qweight(300, 256, 2, seed=m, device=DEV)
    np_ = qw.padded_shape[0]
    half = (m + 1) // 2
    vals = torch.randn(3, 2 * half, np_, generator=g).to(torch.bfloat16)
    vals[:, m:] = float("nan")
    bits = vals.view(torch.int16).to(torch.int32) & 0xFFFF
    words = (bits[:, 0::2] | (bits[:, 1::2] << 16)).to(DEV)
    z = vals[:, :m].float().to(DEV)
    inv = torch.exp2(torch.randint(-5, 6, (m,), generator=g).float()).to(DEV)
    hn = None
    if head:
        hn = HeadNorm((torch.rand(384, generator=g) + 0.5).to(DEV, torch.bfloat16),
                      torch.tensor([1, 0, 0], dtype=torch.int8, device=DEV), 1e-6)

    def out():
        return torch.full((m, 300), float("nan"), dtype=torch.bfloat16, device=DEV)

    want = hadamard_output(z, qw, inv, out(), head_norm=hn)
    assert torch.isfinite(want).all()
    for shape in [None, (1, 4), (2, 2), (8, 4), (16, 4)]:
        assert torch.equal(hadamard_output(words, qw, inv, out(), head_norm=hn, shape=shape), want), shape
    with pytest.raises(ValueError, match="bad shapes"):
        hadamard_output(words[:, :half - 1], qw, inv, out())
    if half > 1:  # (a single word row has unit stride along Np whatever its layout)
        with pytest.raises(ValueError, match="bad shapes"):
            hadamard_output(words.transpose(1, 2).contiguous().transpose(1, 2), qw, inv, out())


def test_hadamard_output_head_norm_against_the_model_norm():
    """The flagged head normalised as HeadNorm.apply does it to the projection's bf16 output."""
    g = torch.Generator().manual_seed(5)
    qw = random_qweight(256, 128, 2, seed=5, device=DEV)
    z = torch.randn(2, 3, 256, generator=g).to(DEV)
    inv = torch.ones(3, device=DEV)
    head = HeadNorm((torch.rand(256, generator=g) + 0.5).to(DEV, torch.bfloat16),
                    torch.tensor([1, 0], dtype=torch.int8, device=DEV), 1e-6)
    plain = hadamard_output(z, qw, inv, torch.empty(3, 256, dtype=torch.bfloat16, device=DEV))
    normed = hadamard_output(z, qw, inv, torch.full((3, 256), float("nan"), dtype=torch.bfloat16, device=DEV),
                             head_norm=head)
    want = head.apply(plain)
    assert torch.equal(normed[:, 128:], plain[:, 128:])  # the unflagged block is untouched
    assert ((normed.float() - want.float()).abs() <= 2.0 ** -7 * want.float().abs() + 1e-6).all()


@pytest.mark.parametrize("halves", [False, True])
def test_prepare_input_rows_past_the_tokens(halves):
    """``rows``: x' allocated with the GEMM's rounded rows (decode_wgmma reads whole token blocks
    by TMA; at 40 tokens, 24 rows of a box zero-filled, gate_up took 44.4 us against 39.1 with
    48 allocated, benchmarks/results/x16_xpad_h200/); the tokens' rows are the bits of an x' of M
    rows, and the factors M; fewer rows than tokens allocate M."""
    g = torch.Generator().manual_seed(3)
    qw = random_qweight(64, 300, 2, seed=3, device=DEV)
    x = torch.randn(5, 300, generator=g).to(DEV, torch.bfloat16)
    want, inv_want, _ = transforms.prepare_input(x, qw, mma_order=True, halves=halves, keep=False)
    got, inv, _ = transforms.prepare_input(x, qw, mma_order=True, halves=halves, keep=False, rows=16)
    assert got.shape == (16, want.shape[1]) and inv.shape == (5,)
    assert torch.equal(got[:5].view(torch.int16), want.view(torch.int16)) and torch.equal(inv, inv_want)
    assert transforms.prepare_input(x, qw, mma_order=True, halves=halves, keep=False, rows=2)[0].shape == want.shape
