"""Viterbi encoder: exact optimality against brute force, tail-biting validity, Triton parity,
and bit-for-bit equality of the CPU DP (viterbi_cpu.py) with the reference path."""
from __future__ import annotations

import itertools

import pytest
import torch

from escha.format import codebooks, words_from_states
from escha.quant.encode import Backend, EncodeOptions, encode_tiles
from escha.quant.greedy import encode_greedy
from escha.quant.viterbi import Trellis, viterbi, viterbi_tailbiting
from escha.quant.viterbi_cpu import plan_layouts, viterbi_cpu



def brute_force(x: torch.Tensor, values: torch.Tensor, tr: Trellis, cyclic: bool) -> float:
    """Minimum error over every walk (every start state and every sequence of new bits)."""
    n = x.shape[0]
    syms = torch.tensor(list(itertools.product(range(1 << tr.bits), repeat=n - 1)), dtype=torch.int64)
    starts = torch.arange(tr.n_states)
    s = starts[:, None].expand(-1, syms.shape[0]).reshape(-1)
    walk = [s]
    for j in range(n - 1):
        s = ((s << tr.bits) & (tr.n_states - 1)) | syms[:, j].repeat(tr.n_states)
        walk.append(s)
    w = torch.stack(walk, 1)
    err = ((values[w] - x[None, :]) ** 2).sum(1)
    if cyclic:
        ok = (w[:, -1] & tr.overlap_mask) == (w[:, 0] >> tr.bits)
        err = err[ok]
    return float(err.min())


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Bit-for-bit equality of (states, errors)."""
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_unconstrained_matches_brute_force(bits: int) -> None:
    torch.manual_seed(bits)
    tr = Trellis(6, bits)
    n = {1: 7, 2: 5, 3: 4}[bits]
    values = torch.randn(tr.n_states)
    x = torch.randn(3, n)
    states, err = viterbi(x, values, tr)
    assert_same(viterbi_cpu(x, values, tr, block_tiles=2), (states, err))
    for i in range(3):
        assert err[i].item() == pytest.approx(brute_force(x[i], values, tr, cyclic=False), rel=1e-5)
        # The returned walk is a walk and its error is the reported one.
        s = states[i]
        assert bool((((s[:-1] << bits) & (tr.n_states - 1)) == (s[1:] & ~((1 << bits) - 1) & (tr.n_states - 1))).all())
        assert float(((values[s] - x[i]) ** 2).sum()) == pytest.approx(err[i].item(), rel=1e-5)


def test_constrained_and_tailbiting_against_brute_force() -> None:
    torch.manual_seed(7)
    tr = Trellis(6, 2)
    values = torch.randn(tr.n_states)
    x = torch.randn(4, 5)
    # Exact cyclic optimum = best over every fixed overlap; the two-pass result is a valid cycle
    # no better than that optimum and no better than the free optimum.
    per_overlap = torch.stack([viterbi(x, values, tr, torch.full((4,), o))[1] for o in range(tr.n_groups)])
    exact = per_overlap.min(0).values
    states, err = viterbi_tailbiting(x, values, tr)
    free = viterbi(x, values, tr)[1]
    for o in range(tr.n_groups):
        ov = torch.full((4,), o)
        assert_same(viterbi_cpu(x, values, tr, ov, block_tiles=3), viterbi(x, values, tr, ov))
    assert_same(viterbi_tailbiting(x, values, tr, dp=viterbi_cpu), (states, err))
    for i in range(4):
        assert exact[i].item() == pytest.approx(brute_force(x[i], values, tr, cyclic=True), rel=1e-5)
        s = states[i]
        assert (s[-1] & tr.overlap_mask) == (s[0] >> tr.bits)
    assert bool((err >= exact - 1e-5).all()) and bool((exact >= free - 1e-5).all())


@pytest.mark.parametrize("bits", [2, 3])
def test_full_trellis_tile_beats_greedy_and_is_cyclic(bits: int) -> None:
    """Full L = 16 on real tiles."""
    torch.manual_seed(10 + bits)
    table = codebooks.get(0).table().float()
    x = torch.randn(1, 256) * float(table.pow(2).mean().sqrt())
    states, err = encode_tiles(x, table, bits)
    words_from_states(states, bits)  # raises unless each walk is a tail-biting walk
    assert torch.allclose(((table[states] - x) ** 2).sum(1), err, rtol=1e-4)
    greedy = ((table[encode_greedy(x, bits, table)] - x) ** 2).sum(1)
    free = encode_tiles(x, table, bits, EncodeOptions(tail_biting=False))[1]
    assert bool((err < 0.8 * greedy).all())
    assert bool((free <= err + 1e-3).all())
    mse = float(err.sum()) / x.numel() / float(table.pow(2).mean())
    assert mse < {2: 0.09, 3: 0.025}[bits]


def test_triton_kernel_matches_reference() -> None:
    """The Triton DP (interpreted on CPU) gives the same walks as the reference, K = 1..4."""
    from escha.quant.viterbi_triton import viterbi_triton
    torch.manual_seed(3)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for bits, big_l, n in ((2, 8, 13), (3, 9, 10), (1, 9, 12), (4, 8, 6)):
        tr = Trellis(big_l, bits)
        values = torch.randn(tr.n_states).half().float().to(dev)
        x = torch.randn(2, n, device=dev)
        overlap = torch.randint(0, tr.n_groups, (2,), device=dev)
        for ov in (None, overlap):
            s_ref, e_ref = viterbi(x, values, tr, ov)
            s_tri, e_tri = viterbi_triton(x, values, tr, ov)
            assert torch.equal(s_ref, s_tri)
            assert torch.allclose(e_ref, e_tri, rtol=1e-6)


def _tie_heavy(tr: Trellis, t: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codewords and targets on a coarse grid: equal path costs, so argmin ties, are common."""
    values = torch.randint(-3, 4, (tr.n_states,)).float() / 2
    return values, torch.randint(-3, 4, (t, n)).float() / 2


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_cpu_dp_equals_reference_full_trellis(bits: int) -> None:
    """L = 16 with the format's codebook and with tie-heavy data, free and with fixed wrap bits;
    block_tiles=2 puts a block boundary inside the batch."""
    torch.manual_seed(20 + bits)
    tr = Trellis(16, bits)
    table = codebooks.get(0).table().float()
    x = torch.randn(3, 24) * float(table.pow(2).mean().sqrt())
    ties_v, ties_x = _tie_heavy(tr, 3, 24)
    overlap = torch.randint(0, tr.n_groups, (3,))
    for values, xs in ((table, x), (ties_v, ties_x)):
        for ov in (None, overlap):
            assert_same(viterbi_cpu(xs, values, tr, ov, block_tiles=2), viterbi(xs, values, tr, ov))


@pytest.mark.parametrize("big_l", [6, 9])
def test_cpu_dp_equals_reference_every_layout_path(big_l: int) -> None:
    """Small L, every K, every walk length from 1 step, and layout thresholds that force pure
    rotation (1), a transpose every step (huge) and the default: the result never changes."""
    torch.manual_seed(big_l)
    for bits in range(1, big_l):
        tr = Trellis(big_l, bits)
        for n in (1, 2, 3, 7):
            for values, x in ((torch.randn(tr.n_states), torch.randn(5, n)), _tie_heavy(tr, 5, n)):
                ov = torch.randint(0, tr.n_groups, (5,))
                for o in (None, ov):
                    want = viterbi(x, values, tr, o)
                    for min_inner in (1, 4, 1 << 30):
                        assert_same(viterbi_cpu(x, values, tr, o, block_tiles=2, min_inner=min_inner), want)


def test_cpu_layout_plan() -> None:
    """Every reduce field fits the storage index, the last step is in state order, and at L=16
    the minima are transposed at most every fourth step (K=2) / second step (K=3)."""
    for big_l, bits in ((16, 1), (16, 2), (16, 3), (16, 4), (6, 4), (7, 3)):
        tr = Trellis(big_l, bits)
        plan = plan_layouts(tr, 256)
        assert plan[0].layout == 0 and plan[-1].layout == 0
        assert all(0 <= s.layout <= big_l - bits for s in plan)
        if big_l == 16:
            period = {1: 9, 2: 4, 3: 2, 4: 1}[bits]
            assert sum(s.transpose for s in plan) <= 256 // period + 1


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_cpu_encoder_is_default_and_equals_reference_encoder(bits: int) -> None:
    """Whole tail-biting encodes (wrap pass + constrained pass) of full 256-weight tiles."""
    torch.manual_seed(30 + bits)
    table = codebooks.get(0).table().float()
    x = torch.randn(2, 256) * float(table.pow(2).mean().sqrt())
    ref = encode_tiles(x, table, bits, EncodeOptions(backend=Backend.TORCH))
    assert_same(encode_tiles(x, table, bits), ref)
    assert_same(encode_tiles(x, table, bits, EncodeOptions(backend=Backend.CPU, batch_tiles=1)), ref)
