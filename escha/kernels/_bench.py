"""Measurement-only variants and handles for the benchmarks (benchmarks/bench_decode.py).

Not part of the kernel API: an ablated kernel computes wrong results on purpose, to split the
decode GEMM's runtime into its parts.
"""
from __future__ import annotations

import enum

import torch

from ..format.qweight import QuantizedWeight
from .decode import DecodeConfig, _launch


class Ablation(enum.IntEnum):
    """Decode GEMM variants that split the runtime (never a default: results are wrong)."""

    NONE = 0
    CODEC_ONLY = 1  # no weight loads: words are synthesized from their indices
    LOADS_ONLY = 2  # no codec: each loaded word's low half is reinterpreted as the fp16 weight


def decode_ablated(x: torch.Tensor, qw: QuantizedWeight, config: DecodeConfig | None = None,
                   ablation: Ablation = Ablation.NONE) -> torch.Tensor:
    """The decode GEMM with ``ablation`` applied (Ablation.NONE is ``decode`` itself)."""
    return _launch(x, qw, config, None, int(ablation))[0]


def decode_kernel_handle(x: torch.Tensor, qw: QuantizedWeight, config: DecodeConfig | None = None):
    """Run the decode GEMM once and return its compiled GEMM kernel (for SASS and register reports)."""
    return _launch(x, qw, config, None)[1]
