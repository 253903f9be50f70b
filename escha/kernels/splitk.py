"""The decode GEMM's split-K rule: how many k-slices each block of output rows is cut into.

Two forces set the best split (the same ones the founding tuning found): each slice must keep
enough k-tiles to amortize its own program (prologue, epilogue, its own partial-sum write), and
the grid must cover the GPU's SMs without piling up too many waves. The rule is

    split = the largest power of two <= MAX_SPLIT with  ktiles / split >= MIN_KTILES
            and  nblk * split <= MAX_PROGRAMS

with nblk = output blocks of 128 rows and ktiles = 16-wide k-tiles. The constants are fitted
by benchmarks/fit_splitk.py on the H200 (results in benchmarks/results/splitk_h200.*); see
docs/KERNELS.md for the table, the fit, and how many measured points it gets exactly.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SplitKRule:
    """Constants of the split-K rule (fitted values are the defaults)."""

    min_ktiles: int = 42
    max_programs: int = 1122
    max_split: int = 8


#: The rule decode_config uses (fitted on the H200; docs/KERNELS.md "Split-K rule").
H200_SPLITK = SplitKRule()


def decode_split_k(nblk: int, ktiles: int, rule: SplitKRule = H200_SPLITK) -> int:
    """Split count for a decode GEMM with ``nblk`` output blocks and ``ktiles`` 16-wide k-tiles."""
    if nblk < 1 or ktiles < 1:
        raise ValueError(f"nblk and ktiles must be positive, got {nblk}, {ktiles}")
    split = 1
    while (split * 2 <= rule.max_split and ktiles / (split * 2) >= rule.min_ktiles
           and nblk * split * 2 <= rule.max_programs):
        split *= 2
    return split
