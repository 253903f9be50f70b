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
    """Order of ``n`` arms in round ``round_index``: the rows of a Williams design (a Latin square
    balanced for carry-over). Over n rounds (2n when n is odd) every arm takes every position
    equally often and follows every other arm equally often, so no arm always runs right after
    the same one: the GPU's clock and power state after a heavy arm can carry into the next. (A
    rotation kept each arm's predecessor fixed. In the dense sweep the automatic escha arm, timed
    right after fp8 cuBLAS in all but one round, measured 2-12% slower at M >= 2048 than the same
    path under its own name, while its fastest sample matched that arm's median.)"""
    if n <= 0:
        return []
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: every difference between neighbours once
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    r = round_index % (n if n % 2 == 0 else 2 * n)
    row = [(x + r) % n for x in first]
    return row if r < n else [(x + r - n) % n for x in first][::-1]  # odd n: the mirrored half


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
