"""Global scale search: the g that minimises trellis MSE on a sample of tiles.

The incoherent target has unit-RMS rows, so the best g is the codebook RMS times a ratio that
depends mostly on K (the trellis reproduces a slightly narrower distribution than its
codebook). The ratio is searched around a per-K prior on evenly spaced sample tiles with the
unconstrained Viterbi, which ranks scales the same as the tail-biting one at half the cost.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .encode import EncodeOptions, encode_tiles

# Target RMS / codebook RMS that minimised i.i.d. Gaussian MSE (benchmarks/results/quant_iid_*).
PRIOR_RATIO = {1: 1.0, 2: 1.0, 3: 0.9, 4: 0.85}
SEARCH_FACTORS = (0.9, 0.95, 1.0, 1.05, 1.1)


@dataclass(frozen=True)
class ScaleSearch:
    """Where to look: ``factors`` multiply the prior ratio; ``sample_tiles`` bounds the cost."""

    factors: tuple[float, ...] = SEARCH_FACTORS
    # None: 256 on CUDA, 8 on CPU (sized when a CPU tile cost ~0.2 s; kept so CPU results stay put)
    sample_tiles: int | None = None

    def tiles_for(self, device: torch.device) -> int:
        """How many tiles to sample on ``device``: ``sample_tiles``, or 256 on CUDA and 8 elsewhere when None."""
        if self.sample_tiles is not None:
            return self.sample_tiles
        return 256 if device.type == "cuda" else 8


def sample_rows(tiles: torch.Tensor, count: int) -> torch.Tensor:
    """Evenly spaced tiles [count, 256] from tiles [T, 256] (deterministic)."""
    t = tiles.shape[0]
    if t <= count:
        return tiles
    idx = torch.linspace(0, t - 1, count, device=tiles.device).round().long()
    return tiles[idx]


def search_ratio(tiles: torch.Tensor, table: torch.Tensor, bits: int, search: ScaleSearch | None) -> float:
    """The ratio (target RMS over codebook RMS at the trellis input) with the least sample MSE."""
    prior = PRIOR_RATIO[bits]
    if search is None or len(search.factors) <= 1:
        return prior * (search.factors[0] if search and search.factors else 1.0)
    sample = sample_rows(tiles, search.tiles_for(tiles.device)).float()
    rms = float(sample.pow(2).mean().sqrt())
    if rms == 0:
        return prior
    table_rms = float(table.float().pow(2).mean().sqrt())
    best, best_err = prior, float("inf")
    for f in search.factors:
        ratio = prior * f
        g = rms / (ratio * table_rms)
        _, err = encode_tiles(sample / g, table, bits, EncodeOptions(tail_biting=False))
        mse = float(err.sum()) * g * g
        if mse < best_err:
            best, best_err = ratio, mse
    return best
