"""Greedy tail-biting trellis encoder: the simple baseline that the Viterbi encoder must beat."""
from __future__ import annotations

import torch

from ..format.spec import STATE_BITS, STATE_MASK, TILE_WEIGHTS


def encode_greedy(seqs: torch.Tensor, bits: int, table: torch.Tensor) -> torch.Tensor:
    """Choose each state in turn as the nearest codeword its predecessor allows.

    seqs: float32 [T, 256] targets. table: codebook values of all 2**16 states.
    Returns int64 states [T, 256] forming valid tail-biting walks: the last windows wrap onto
    bits fixed by the first state, and candidates that contradict them are excluded.
    """
    n_bits = TILE_WEIGHTS * bits
    vals = table.float().to(seqs.device)
    order = torch.argsort(vals)
    sorted_vals = vals[order]
    # State 0: the nearest of all 65536 values (searchsorted, then compare both neighbours).
    pos = torch.searchsorted(sorted_vals, seqs[:, 0].contiguous()).clamp(1, vals.numel() - 1)
    left, right = sorted_vals[pos - 1], sorted_vals[pos]
    pick = torch.where((seqs[:, 0] - left).abs() <= (right - seqs[:, 0]).abs(), pos - 1, pos)
    states = torch.empty(seqs.shape, dtype=torch.int64, device=seqs.device)
    states[:, 0] = order[pick]
    first = states[:, 0]
    cand = torch.arange(1 << bits, device=seqs.device)
    for j in range(1, TILE_WEIGHTS):
        s = ((states[:, j - 1, None] << bits) & STATE_MASK) | cand  # [T, 2^K]
        err = (vals[s] - seqs[:, j, None]).abs()
        # New bits sit at stream positions K*j+16-K+i; past the end they wrap onto state 0's bits.
        for i in range(bits):
            p = bits * j + STATE_BITS - bits + i
            if p >= n_bits:
                fixed = (first >> (STATE_BITS - 1 - (p - n_bits))) & 1
                mine = (cand >> (bits - 1 - i)) & 1
                err = torch.where(mine[None, :] == fixed[:, None], err, torch.inf)
        states[:, j] = s.gather(1, err.argmin(1, keepdim=True)).squeeze(1)
    return states
