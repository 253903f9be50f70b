"""Choosing K in {2, 3} per Linear to meet an average bits-per-weight budget."""
from __future__ import annotations

from .options import LinearStats


def allocate_bits(stats: list[LinearStats], target_bpw: float, low: int = 2, high: int = 3) -> dict[str, int]:
    """Greedy allocation by proxy-loss reduction per extra stored bit.

    Every Linear starts at ``low``; upgrades go to the largest ``(loss_low - loss_high) / params``
    first (loss reduction per extra bit, since one more bit per weight costs ``params`` bits) while
    the parameter-weighted mean K stays <= ``target_bpw``. A Linear too large for the remaining
    budget is passed over for smaller ones.
    """
    total = sum(s.params for s in stats)
    if total == 0:
        return {}
    budget = target_bpw * total - low * total  # extra bits available
    choice = {s.name: low for s in stats}
    gain = sorted(stats, key=lambda s: (s.proxy[low] - s.proxy[high]) / s.params, reverse=True)
    for s in gain:
        cost = (high - low) * s.params
        if cost <= budget + 1e-9 and s.proxy[low] > s.proxy[high]:
            choice[s.name] = high
            budget -= cost
    return choice


def mean_bits(stats: list[LinearStats], choice: dict[str, int]) -> float:
    """Parameter-weighted mean of the chosen K."""
    total = sum(s.params for s in stats)
    return sum(choice[s.name] * s.params for s in stats) / total if total else 0.0
