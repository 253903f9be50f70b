"""Triton kernels for the exact Viterbi encoder: fused multi-step DP and traceback.

Steps j..j+D of a bit-shift trellis decompose into independent groups: every window from
step j to step j+D contains the same L-K*D "core" bits (stream bits K(j+D) .. Kj+L), so the
2^(K*D) states of one core at each of those steps only ever reach each other. A program holds
C cores x 2^(K*D) costs in registers, runs D steps there, and touches global memory once per D
steps; inside, the states of one core form a small shift register of K*D bits, so a step is
the same reshape / min / broadcast as the reference path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .viterbi import EXCLUDED, Trellis

# Steps fused per launch for each K: K*D state bits per core group in registers.
STEPS_PER_LAUNCH = {1: 8, 2: 4, 3: 3, 4: 2}


@dataclass(frozen=True)
class ViterbiLaunch:
    """Launch parameters of the DP kernel; ``viterbi_launch`` is the rule that picks them."""

    program_states: int  # states held by one program (cores x group states)
    num_warps: int


def viterbi_launch(trellis: Trellis, device: torch.device) -> ViterbiLaunch:
    """The rule: 2048 states a program at 4 warps, the fastest of 2048/4096/8192 x 4/8 warps on
    the H200 (benchmarks/bench_quant.py tune_launch); the same for every trellis and device."""
    return ViterbiLaunch(program_states=2048, num_warps=4)


@triton.jit
def _dp_chunk_kernel(cost_in, cost_out, bp_ptr, x_ptr, table_ptr, t0, n_tiles, n,
                     BITS: tl.constexpr, D: tl.constexpr, C: tl.constexpr, L: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    S: tl.constexpr = 1 << (BITS * D)
    P: tl.constexpr = S >> BITS
    CORE: tl.constexpr = L - BITS * D
    G1: tl.constexpr = 1 << (L - BITS)
    c = (tl.program_id(1) * C + tl.arange(0, C))[:, None]  # core values [C, 1]
    f = tl.arange(0, S)[None, :]  # group-local state [1, S]
    pf = tl.arange(0, P)[None, :]
    # At step offset 0 the group-local bits all precede the core.
    cost = tl.load(cost_in + tile * (1 << L) + ((f << CORE) | c))
    for i in tl.static_range(D):
        cost3 = tl.reshape(cost, (C, 1 << BITS, P))
        m, a = tl.min(cost3, axis=1, return_indices=True)
        # Predecessor group p = s_new >> BITS of each new state, in global numbering.
        p = ((pf >> (BITS * i)) << (L - BITS * (D - i))) | (c << (BITS * i)) | (pf & ((1 << (BITS * i)) - 1))
        t = t0 + i
        tl.store(bp_ptr + (t * n_tiles + tile) * G1 + p, a.to(tl.uint8))
        cost = tl.reshape(tl.broadcast_to(m[:, :, None], (C, P, 1 << BITS)), (C, S))
        j = i + 1
        s = ((f >> (BITS * j)) << (L - BITS * (D - j))) | (c << (BITS * j)) | (f & ((1 << (BITS * j)) - 1))
        v = tl.load(table_ptr + s).to(tl.float32)
        xv = tl.load(x_ptr + tile * n + t)
        d = v - xv
        cost = cost + d * d
    tl.store(cost_out + tile * (1 << L) + ((c << (BITS * D)) | f), cost)


@triton.jit
def _traceback_kernel(last_ptr, bp_ptr, states_ptr, n_tiles, n: tl.constexpr,
                      BITS: tl.constexpr, L: tl.constexpr, BLOCK: tl.constexpr):
    tiles = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = tiles < n_tiles
    t64 = tiles.to(tl.int64)
    s = tl.load(last_ptr + tiles, mask=mask, other=0).to(tl.int32)
    tl.store(states_ptr + t64 * n + (n - 1), s, mask=mask)
    for tt in range(1, n):
        t = n - tt
        p = s >> BITS
        a = tl.load(bp_ptr + (t * n_tiles + t64) * (1 << (L - BITS)) + p, mask=mask, other=0).to(tl.int32)
        s = (a << (L - BITS)) | p
        tl.store(states_ptr + t64 * n + (t - 1), s, mask=mask)


def chunk_plan(trellis: Trellis, n: int) -> list[tuple[int, int]]:
    """(first step, steps) of each launch covering steps 1 .. n-1."""
    d_max = min(STEPS_PER_LAUNCH.get(trellis.bits, 1), trellis.state_bits // trellis.bits)
    plan, t = [], 1
    while t < n:
        d = min(d_max, n - t)
        plan.append((t, d))
        t += d
    return plan


def viterbi_triton(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
                   overlap: torch.Tensor | None = None, *,
                   config: ViterbiLaunch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as escha.quant.viterbi.viterbi; runs on CUDA (or TRITON_INTERPRET=1).

    ``config`` overrides ``viterbi_launch``.
    """
    cfg = config or viterbi_launch(trellis, x.device)
    t_count, n = x.shape
    big_l, k = trellis.state_bits, trellis.bits
    x = x.float().contiguous()
    table16 = values.to(device=x.device, dtype=torch.float16).contiguous()
    v32 = table16.float()
    states_all = torch.arange(trellis.n_states, device=x.device)
    cost = (v32[None, :] - x[:, :1]).square_()
    if overlap is not None:
        cost = torch.where((states_all[None, :] >> k) == overlap[:, None], cost, EXCLUDED)
    cost = cost.contiguous()
    other = torch.empty_like(cost)
    bp = torch.empty((n, t_count, trellis.n_groups), dtype=torch.uint8, device=x.device)
    for t0, d in chunk_plan(trellis, n):
        s = 1 << (k * d)
        c = min(max(cfg.program_states // s, 1), 1 << (big_l - k * d))
        grid = (t_count, (1 << (big_l - k * d)) // c)
        _dp_chunk_kernel[grid](cost, other, bp, x, table16, t0, t_count, n,
                               BITS=k, D=d, C=c, L=big_l, num_warps=cfg.num_warps)
        cost, other = other, cost
    if overlap is not None:
        cost = torch.where((states_all[None, :] & trellis.overlap_mask) == overlap[:, None], cost, EXCLUDED)
    best, last = cost.min(dim=1)
    states = torch.empty((t_count, n), dtype=torch.int32, device=x.device)
    block = 128
    _traceback_kernel[(triton.cdiv(t_count, block),)](last.to(torch.int32).contiguous(), bp, states,
                                                       t_count, n, BITS=k, L=big_l, BLOCK=block)
    return states.to(torch.int64), best
