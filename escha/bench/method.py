"""The measurement method as pure functions: rotation buffer counts, interleaving, statistics."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence

# The working set of rotated weights must be at least this many times the GPU's L2,
# so that no arm is timed with its weights cache-resident.
L2_FACTOR = 4
# More calls per graph than this only lengthens capture; tiny custom shapes hit it.
MAX_BUFFERS = 512
MIN_ROUNDS = 5


def rotation_buffers(l2_bytes: int, buffer_bytes: float, factor: int = L2_FACTOR,
                     maximum: int = MAX_BUFFERS) -> int:
    """Buffers needed so that ``count * buffer_bytes >= factor * l2_bytes`` (at least 1, at most ``maximum``)."""
    if buffer_bytes <= 0:
        raise ValueError(f"buffer_bytes must be positive, got {buffer_bytes}")
    if l2_bytes < 0:
        raise ValueError(f"l2_bytes must be non-negative, got {l2_bytes}")
    need = math.ceil(factor * l2_bytes / buffer_bytes)
    return max(1, min(maximum, need))


def round_order(n: int, round_index: int) -> list[int]:
    """Order of ``n`` arms in round ``round_index``: rotated by one each round, so every
    arm takes every position (first, after arm X, last) equally often over ``n`` rounds."""
    if n <= 0:
        return []
    s = round_index % n
    return [(s + i) % n for i in range(n)]


@dataclass(frozen=True)
class Spread:
    """Median with min/max of a timing sample set, in microseconds."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> "Spread":
        """Summarize samples; NaN for all three when there are none (an arm refused timing)."""
        if not samples:
            nan = float("nan")
            return cls(nan, nan, nan)
        return cls(float(statistics.median(samples)), float(min(samples)), float(max(samples)))
