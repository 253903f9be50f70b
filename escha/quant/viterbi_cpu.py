"""Exact Viterbi for the CPU: a min-only forward pass over blocks of tiles, traceback by recomputation.

Same contract and bit-for-bit the same result as ``escha.quant.viterbi.viterbi`` (the reference):
every cost is formed by the same float32 operations in the same order, so minima, ties and the
first-index tie rule all agree. What changes is how the work is laid out:

* **No argmin in the forward pass.** A step keeps only the group minima m_j (2^(L-K) floats per
  tile). The traceback recomputes the one argmin it needs per step from m_{j-1} and 2^K
  emissions, which are the same float32 values the forward pass compared.
* **Rotated cost layout.** In state order, a step reduces over the top K bits (contiguous rows)
  but broadcasts the minima over the bottom K bits (runs of 2^K elements), which torch executes
  ~6x slower than a contiguous add. The costs are therefore stored with the state rotated right
  by c bits: the reduce field and the broadcast field are then the same K storage bits, and each
  step moves them K bits down (c += K). Before they get too close to the bottom (short
  contiguous runs), the minima, a quarter of the data at K=2, are transposed back to state
  order and c restarts at K. The emission table is permuted once per layout, so the emission is
  computed directly in the rotated order.
* **Blocks of tiles**: a step is one reduce, one emission (subtract, square) and one broadcast
  add over [block, 2^L] float32 tensors in reused buffers; the thread count of each block is
  chosen by cpu_threads.ThreadGovernor (torch's threads on an idle machine, else one).

Memory: the minima history, (n-1) x 2^(L-K) floats per tile (16 MiB at K=2), bounds the block.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

from .cpu_threads import ThreadGovernor
from .viterbi import EXCLUDED, Trellis

# Tiles per block: [16, 2^16] float32 is 4 MiB per buffer, within the shared L3 and large
# enough that per-op overhead is small (benchmarks/bench_viterbi_cpu.py --blocks measures 4-32).
BLOCK_TILES = 16
# Shortest contiguous run a reduce/broadcast may have before the minima are transposed back
# to state order. A transpose of the minima costs about one step; runs of 16 elements make a
# step ~10x slower, runs of 64-256 are within noise of the longest (measured 32..1024, K=1..4).
MIN_INNER = 64
# Minima history of one block: 16 tiles at K=2 (n=256) fit; K=1 gets 8 tiles.
HIST_BUDGET_BYTES = 256 << 20


@dataclass(frozen=True)
class Step:
    """Layout of step j: cost_j is stored at rotr(state, ``layout``); the minima m_{j-1} that
    feed it were in layout ``m_layout`` (after an optional transpose to state order)."""

    layout: int
    m_layout: int
    transpose: bool


def plan_layouts(trellis: Trellis, n: int, min_inner: int = MIN_INNER) -> list[Step]:
    """Layout of each of the n steps; the last step is in state order (layout 0).

    m_layout is the rotation of the minima the step broadcasts (rotr over the L-K group bits);
    0 and L-K are both plain state order, broadcast at the top (giving layout K) or at the
    bottom (giving layout 0) of the storage index.
    """
    big_l, k = trellis.state_bits, trellis.bits
    steps = [Step(0, 0, False)]
    for j in range(1, n):
        c = steps[-1].layout
        nxt = c + k
        keep_ok = (nxt <= big_l - k and (1 << (big_l - k - nxt)) >= min_inner) or nxt == big_l
        if j == n - 1:
            # The final costs go to state order so that the final argmin breaks ties by state.
            steps.append(Step(0, big_l - k, c not in (0, big_l - k)))
        elif keep_ok:
            steps.append(Step(nxt % big_l, c, False))
        elif 2 * k <= big_l:
            steps.append(Step(k, 0, c not in (0, big_l - k)))
        else:  # the top placement would leave no room for the next reduce: broadcast at the bottom
            steps.append(Step(0, big_l - k, c not in (0, big_l - k)))
    return steps


def _rotl(idx: torch.Tensor, c: int, bits: int) -> torch.Tensor:
    c %= bits
    if c == 0:
        return idx
    return ((idx << c) | (idx >> (bits - c))) & ((1 << bits) - 1)


def _rotr(idx: torch.Tensor, c: int, bits: int) -> torch.Tensor:
    return _rotl(idx, bits - c % bits, bits)


def _shape(trellis: Trellis, c: int) -> tuple[int, int, int]:
    """Storage index at layout c as (high, field, low): the field holds the state's top K bits."""
    big_l, k = trellis.state_bits, trellis.bits
    return 1 << c, 1 << k, 1 << (big_l - k - c)


class Workspace:
    """State shared by the DP calls of one encode: buffers, because first-touching the pages of
    a fresh minima history (hundreds of MiB) costs about as much as the DP that fills it, and
    the thread governor, whose load measurements span calls."""

    def __init__(self, governor: ThreadGovernor | None = None) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self.governor = governor or ThreadGovernor()

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A float32 tensor of ``shape`` (uninitialised), reusing the memory of earlier takes."""
        numel = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < numel:
            buf = self._bufs[name] = torch.empty(numel, dtype=torch.float32)
        return buf[:numel].view(shape)

    def reserve(self, trellis: Trellis, n: int, tiles: int | None = None) -> None:
        """Size the buffers for ``tiles`` walks of n steps now, so that shorter passes first do
        not cause a second allocation (the tail-biting wrap pass is shorter than the tile)."""
        b = min(block_size(trellis, n), tiles or BLOCK_TILES)
        self.take("hist", (max(n - 1, 0), b, trellis.n_groups))


_SHARED: ContextVar[Workspace | None] = ContextVar("escha_viterbi_cpu_workspace", default=None)


@contextmanager
def reuse_buffers(trellis: Trellis | None = None, n: int = 0, tiles: int | None = None,
                  threads: int | None = None) -> Iterator[Workspace]:
    """Every ``viterbi_cpu`` call inside the block shares one Workspace (an enclosing block's,
    if any); it is freed when the outermost block ends. ``trellis``/``n``/``tiles`` reserve its
    size; ``threads`` fixes the thread count of a new Workspace (None: ThreadGovernor decides)."""
    ws = _SHARED.get()
    token = None
    if ws is None:
        ws = Workspace(None if threads is None else ThreadGovernor.fixed(threads))
        token = _SHARED.set(ws)
    try:
        if trellis is not None:
            ws.reserve(trellis, n, tiles)
        yield ws
    finally:
        if token is not None:
            _SHARED.reset(token)


def block_size(trellis: Trellis, n: int, hist_budget: int = HIST_BUDGET_BYTES) -> int:
    """Tiles per block: at most BLOCK_TILES, and a minima history within ``hist_budget`` bytes."""
    per_tile = max(n - 1, 1) * trellis.n_groups * 4
    return max(1, min(BLOCK_TILES, hist_budget // per_tile))


def viterbi_cpu(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
                overlap: torch.Tensor | None = None, *, block_tiles: int | None = None,
                min_inner: int = MIN_INNER, workspace: Workspace | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and result as ``escha.quant.viterbi.viterbi``, on CPU tensors.

    x: float32 [T, n]; values: [2^L] codeword of each state; overlap: optional int64 [T] fixing
    state_0 >> K and state_{n-1} & (2^(L-K) - 1). Returns (states int64 [T, n], error float32 [T]).
    ``block_tiles``, ``min_inner`` and ``workspace`` change speed and memory only, never the result.
    """
    t_count, n = x.shape
    x = x.float().cpu()
    values = values.float().cpu()
    block = block_tiles or block_size(trellis, n)
    ws = workspace or _SHARED.get() or Workspace()
    plan = plan_layouts(trellis, n, min_inner)
    state_idx = torch.arange(trellis.n_states)
    tables = {c: values[_rotl(state_idx, c, trellis.state_bits)].contiguous()
              for c in {s.layout for s in plan}}
    states = torch.empty((t_count, n), dtype=torch.int64)
    best = torch.empty(t_count, dtype=torch.float32)
    try:
        for lo in range(0, t_count, block):
            hi = min(t_count, lo + block)
            ws.governor.before_block()
            ov = None if overlap is None else overlap[lo:hi].to(torch.int64).cpu()
            hist, last, best[lo:hi] = _forward(x[lo:hi].contiguous(), tables, trellis, plan, ov, ws)
            states[lo:hi] = _traceback(x[lo:hi], values, trellis, plan, hist, last, ov)
    finally:
        ws.governor.restore()
    return states, best


def _forward(x: torch.Tensor, tables: dict[int, torch.Tensor], trellis: Trellis, plan: list[Step],
             overlap: torch.Tensor | None, ws: Workspace
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Minima m_j of every step but the last ([n-1, B, 2^(L-K)], each in its step's layout),
    then the final state and error of each tile."""
    b, n = x.shape
    k, g = trellis.bits, trellis.n_groups
    hist = ws.take("hist", (max(n - 1, 0), b, g))
    scratch = ws.take("scratch", (b, g))
    cost = ws.take("cost", (b, trellis.n_states))
    # Emission (v[s] - x_j)^2: a subtract and an in-place square, as in the reference.
    torch.sub(tables[0], x[:, :1], out=cost).square_()
    if overlap is not None:
        allowed = (torch.arange(trellis.n_states)[None, :] >> k) == overlap[:, None]
        cost.masked_fill_(~allowed, EXCLUDED)
    for j in range(1, n):
        prev, step = plan[j - 1], plan[j]
        hi, f, lo = _shape(trellis, prev.layout)
        m = hist[j - 1]
        torch.amin(cost.view(b, hi, f, lo), dim=2, out=m.view(b, hi, lo))
        if step.transpose:  # back to state order: a [2^c, 2^(L-K-c)] transpose per tile
            hi_m = 1 << prev.layout
            scratch.view(b, g // hi_m, hi_m).copy_(m.view(b, hi_m, g // hi_m).transpose(1, 2))
            m = scratch
        torch.sub(tables[step.layout], x[:, j:j + 1], out=cost).square_()
        hi, f, lo = _shape(trellis, step.m_layout)
        cost.view(b, hi, f, lo).add_(m.view(b, hi, 1, lo))
    if overlap is not None:
        allowed = (torch.arange(trellis.n_states)[None, :] & trellis.overlap_mask) == overlap[:, None]
        cost.masked_fill_(~allowed, EXCLUDED)
    best, last = cost.min(dim=1)
    return hist, last, best


def _traceback(x: torch.Tensor, values: torch.Tensor, trellis: Trellis, plan: list[Step],
               hist: torch.Tensor, last: torch.Tensor, overlap: torch.Tensor | None) -> torch.Tensor:
    """Walk back from the final states, recomputing each step's 2^K candidate costs exactly."""
    b, n = x.shape
    k, big_l = trellis.bits, trellis.state_bits
    gb = big_l - k
    states = torch.empty((b, n), dtype=torch.int64)
    s = last.to(torch.int64)
    states[:, n - 1] = s
    tops = (torch.arange(1 << k) << gb)[None, :]
    for j in range(n - 1, 0, -1):
        p = s >> k
        cand = tops | p[:, None]  # the 2^K predecessors of group p, in argmin order
        cost = (values[cand] - x[:, j - 1:j]).square_()
        if j - 1 >= 1:
            # cost_{j-1}[s] = m_{j-2}[s >> K] + emission, with m_{j-2} in step j-2's layout.
            pos = _rotr(cand >> k, plan[j - 2].layout, gb)
            cost = hist[j - 2].gather(1, pos).add_(cost)
        elif overlap is not None:
            cost = cost.masked_fill_((cand >> k) != overlap[:, None], EXCLUDED)
        a = cost.argmin(dim=1)
        s = (a << gb) | p
        states[:, j - 1] = s
    return states
