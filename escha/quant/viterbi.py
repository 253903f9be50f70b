"""Exact Viterbi encoding of bit-shift trellis codes (reference PyTorch path).

A trellis with L state bits and K bits per step: state_{j+1} = ((state_j << K) & mask) | new bits,
so the predecessors of state s are (a << (L-K)) | (s >> K) for a in [0, 2^K). Viewing the cost
vector as [2^K, 2^(L-K)] makes one step a min over dim 0 followed by a broadcast over the K new
bits: O(2^L) per step and no gathers. The argmin a is shared by the 2^K successors of a
predecessor group, so a step's backpointers are 2^(L-K) values of K bits, stored bit-packed.

The code is generic over L so that tests can check it against brute force at small L; the
format uses L = 16 (escha.format.spec.STATE_BITS).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Cost given to states a constraint excludes: large but finite, so min/argmin stay well defined.
EXCLUDED = 1e30


@dataclass(frozen=True)
class Trellis:
    """Shape of a bit-shift trellis: ``state_bits`` (L) and ``bits`` per step (K)."""

    state_bits: int
    bits: int

    def __post_init__(self) -> None:
        if not 1 <= self.bits < self.state_bits:
            raise ValueError(f"need 1 <= bits < state_bits, got K={self.bits}, L={self.state_bits}")

    @property
    def n_states(self) -> int:
        """2^L states."""
        return 1 << self.state_bits

    @property
    def n_groups(self) -> int:
        """Predecessor groups: states sharing their low L-K bits."""
        return 1 << (self.state_bits - self.bits)

    @property
    def overlap_mask(self) -> int:
        """2^(L-K) - 1: selects the low L-K bits a state shares with its successor's high bits."""
        return self.n_groups - 1

    @property
    def field_bits(self) -> int:
        """Bits per packed backpointer: K rounded up to a divisor of 8."""
        return next(f for f in (1, 2, 4, 8) if f >= self.bits)


def pack_backpointers(a: torch.Tensor, field_bits: int) -> torch.Tensor:
    """uint8 [..., G] of values < 2^field_bits -> uint8 [..., G*field_bits/8]."""
    per = 8 // field_bits
    if per == 1:
        return a.to(torch.uint8)
    shifts = torch.arange(per, device=a.device, dtype=torch.int32) * field_bits
    v = a.to(torch.int32).unflatten(-1, (-1, per)) << shifts
    return v.sum(-1).to(torch.uint8)


def unpack_backpointer(packed: torch.Tensor, idx: torch.Tensor, field_bits: int) -> torch.Tensor:
    """Entry ``idx`` [T] of each row of packed [T, G*field_bits/8] -> int64 [T]."""
    per = 8 // field_bits
    byte = packed.gather(1, (idx // per)[:, None]).squeeze(1).to(torch.int64)
    return (byte >> ((idx % per) * field_bits)) & ((1 << field_bits) - 1)


def _emission(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(v[s] - x_t)^2 for every state: [T, 2^L]."""
    return (values[None, :] - x[:, None]).square_()


def viterbi(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
            overlap: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Minimum squared-error state walk for each row of x.

    x: float32 [T, n] targets; values: float32 [2^L] codeword of each state.
    overlap: optional int64 [T]: forces state_0 >> K == overlap and
    state_{n-1} & (2^(L-K) - 1) == overlap, i.e. a tail-biting walk whose wrap bits are fixed.
    Returns (states int64 [T, n], total squared error float32 [T]).
    """
    t_count, n = x.shape
    k, g = trellis.bits, trellis.n_groups
    x = x.float()
    values = values.float().to(x.device)
    cost = _emission(values, x[:, 0])
    if overlap is not None:
        allowed = (torch.arange(trellis.n_states, device=x.device)[None, :] >> k) == overlap[:, None]
        cost = torch.where(allowed, cost, EXCLUDED)
    bps = []
    for j in range(1, n):
        m, a = cost.view(t_count, 1 << k, g).min(dim=1)
        bps.append(pack_backpointers(a, trellis.field_bits))
        # Broadcast-add into the fresh emission buffer: one pass instead of expand + copy + add.
        cost = _emission(values, x[:, j])
        cost.view(t_count, g, 1 << k).add_(m[:, :, None])
    if overlap is not None:
        allowed = (torch.arange(trellis.n_states, device=x.device)[None, :] & trellis.overlap_mask) == overlap[:, None]
        cost = torch.where(allowed, cost, EXCLUDED)
    best, last = cost.min(dim=1)
    return traceback(last, bps, trellis), best


def traceback(last: torch.Tensor, bps: list[torch.Tensor], trellis: Trellis) -> torch.Tensor:
    """Walk packed backpointers (one [T, bytes] per step 1..n-1) back from the final states."""
    n = len(bps) + 1
    states = torch.empty(last.shape[0], n, dtype=torch.int64, device=last.device)
    s = last.to(torch.int64)
    states[:, n - 1] = s
    shift = trellis.state_bits - trellis.bits
    for j in range(n - 1, 0, -1):
        p = s >> trellis.bits
        s = (unpack_backpointer(bps[j - 1], p, trellis.field_bits) << shift) | p
        states[:, j - 1] = s
    return states


Dp = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def rotation_overlap(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
                     window: int | None = None, dp: Dp = viterbi) -> torch.Tensor:
    """Pass 1 of tail-biting: wrap bits read off an unconstrained walk across the wrap point.

    The sequence is rotated so that the wrap point (between positions n-1 and 0) sits in the
    middle of a window of ``window`` steps (default: the whole sequence); the state the
    unconstrained optimum takes at position 0 gives the L-K overlap bits.
    """
    n = x.shape[1]
    w = n if window is None else min(window, n)
    half = w // 2
    seg = torch.cat([x[:, n - half:], x[:, : w - half]], dim=1).contiguous()
    states, _ = dp(seg, values, trellis)
    return states[:, half] >> trellis.bits


def viterbi_tailbiting(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
                       window: int | None = None, dp: Dp = viterbi) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-pass tail-biting Viterbi: fix the wrap bits from a rotated pass, then solve exactly
    under that constraint. Returns (states [T, n], squared error [T]); the walk is cyclic.

    ``dp`` is the exact DP to use (this module's ``viterbi`` or the Triton one).
    """
    overlap = rotation_overlap(x, values, trellis, window, dp)
    return dp(x, values, trellis, overlap)
