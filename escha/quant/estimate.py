"""How long the exact Viterbi encoder will take, from measured throughput.

Rates are tail-biting tiles per second (a tile = 256 weights; wrap pass + constrained pass), as
committed under benchmarks/results/. A caller that has timed a first batch on its own machine
passes that rate instead.
"""
from __future__ import annotations

import torch

from .scale import ScaleSearch

# benchmarks/results/viterbi_cpu.json: median of 3 on an idle 2-core AMD EPYC (Zen 4) VM, by
# thread count; 1 thread is also what the encoder falls back to while other processes use the
# cores (and then gets only the share of a core they leave).
CPU_TILES_PER_S = {
    1: {1: 63.0, 2: 75.0, 3: 88.0, 4: 94.0},
    2: {1: 96.0, 2: 126.0, 3: 143.0, 4: 156.0},
}
# H200, Triton kernels: 348,160 tiles in 20.6 s at K=2 (quant_speed_h200.json); K=3 scaled by the
# K=3/K=2 ratio of quant_iid_h200.json (4,096 tiles). K=1 and K=4 were not measured: K=2's rate.
CUDA_TILES_PER_S = {2: 16900.0, 3: 13900.0}
# A pass without tail-biting is 256 steps against 128 + 256 for a tail-biting tile.
UNCONSTRAINED_PASS_COST = 256 / 384


def encoder_tiles_per_s(bits: int, device: torch.device | str = "cpu", threads: int = 1) -> float:
    """Measured tail-biting tiles/s of the default encoder for K = ``bits`` on ``device``.

    CPU rates beyond 2 threads were not measured; the 2-thread rate stands in (a lower bound
    where the extra cores are idle).
    """
    if torch.device(device).type == "cuda":
        table = CUDA_TILES_PER_S
    else:
        table = CPU_TILES_PER_S[1 if threads <= 1 else 2]
    if bits in table:
        return table[bits]
    return table[min(table, key=lambda k: abs(k - bits))]


def estimate_seconds(n_tiles: int, bits: int, device: torch.device | str = "cpu", *,
                     threads: int = 1, tiles_per_s: float | None = None,
                     scale_search: bool = True) -> float:
    """Seconds ``escha.quantize``'s Viterbi encoder needs for ``n_tiles`` tiles.

    n_tiles: (out/16) x (in/16) after padding to multiples of 128; bits: K; threads: torch's
    thread count (CPU); tiles_per_s: a rate measured on this machine, overriding the table;
    scale_search: add the default global-scale search. Pure: reads no clock and no global state.
    """
    if n_tiles < 0:
        raise ValueError(f"n_tiles must be >= 0, got {n_tiles}")
    rate = tiles_per_s if tiles_per_s is not None else encoder_tiles_per_s(bits, device, threads)
    if rate <= 0:
        raise ValueError(f"tiles_per_s must be > 0, got {rate}")
    work = float(n_tiles)
    if scale_search:  # the default search: every factor on a sample of tiles, one pass each
        default = ScaleSearch()
        sample = min(n_tiles, default.tiles_for(torch.device(device)))
        work += len(default.factors) * sample * UNCONSTRAINED_PASS_COST
    return work / rate
