"""Choosing K in {2, 3} per Linear to meet an average bits-per-weight budget."""
from __future__ import annotations

from .options import LinearStats


def allocate_bits(stats: list[LinearStats], target_bpw: float, low: int = 2, high: int = 3) -> dict[str, int]:
    """Greedy allocation by proxy-loss reduction per extra stored bit.

    The units are the Linears, except that Linears quantized together over one input
    (``LinearStats.shared_input``) form one unit and get one K, so they still run as one product.
    Every unit starts at ``low``; upgrades go to the largest ``(loss_low - loss_high) / params``
    first (loss reduction per extra bit, since one more bit per weight costs ``params`` bits) while
    the parameter-weighted mean K stays <= ``target_bpw``. A unit too large for the remaining
    budget is passed over for smaller ones.
    """
    total = sum(s.params for s in stats)
    if total == 0:
        return {}
    units: dict[str, list[LinearStats]] = {}
    for s in stats:
        units.setdefault(s.shared_input or s.name, []).append(s)

    def params(u: list[LinearStats]) -> int:
        return sum(s.params for s in u)

    def loss(u: list[LinearStats], k: int) -> float:
        return sum(s.proxy[k] for s in u)

    budget = target_bpw * total - low * total  # extra bits available
    choice = {s.name: low for s in stats}
    gain = sorted(units.values(), key=lambda u: (loss(u, low) - loss(u, high)) / params(u), reverse=True)
    for u in gain:
        cost = (high - low) * params(u)
        if cost <= budget + 1e-9 and loss(u, low) > loss(u, high):
            choice.update({s.name: high for s in u})
            budget -= cost
    return choice


def mean_bits(stats: list[LinearStats], choice: dict[str, int]) -> float:
    """Parameter-weighted mean of the chosen K."""
    total = sum(s.params for s in stats)
    return sum(choice[s.name] * s.params for s in stats) / total if total else 0.0
