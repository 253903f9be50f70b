"""escha's own matmul, at its default path (``escha``) and at each named path (``escha-<path>``)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

import escha
from escha.format import QuantizedWeight, random_qweight
from escha.ops import available_paths, resolve_path

from .base import DEFAULT_TOLERANCE, Arm, ArmMeta

# The gate of paths whose GEMM operands are fp8 e4m3 (KernelPath.fp8_operands): their relative
# error is ~4e-2 (docs/KERNELS.md, prefill tolerance table), so it is wider than the 16-bit paths'.
FP8_TOLERANCE = 8e-2

BITS = 2
# Integer ops per decoded weight, for the codec-floor column: the fewest any escha kernel issues,
# a step of the register-operand decode loop at K=2 and one token (3.69: IMAD, LOP3, PRMT, SHF and
# the like, the tile-end store counted once a part of a row tile; gate_up's census in
# benchmarks/results/exact_hadd_h200/final/census_share.json, sm_90a SASS). The same floor for
# every path.
INT_OPS_PER_WEIGHT = 3.69
# The activations the target models run in, as the cuBLAS arms get them. With fp16 the
# dequant-fp8 path pays a cast of its whole bf16 output (torch._scaled_mm's row-wise kernels
# return bf16 only), up to 35% of its time at M = 8192 (docs/KERNELS.md, Prefill).
ACT_DTYPE = torch.bfloat16
WILDCARD = "*"
PREFIX = "escha"

_seeds = itertools.count(1)


def _random_qweight(N: int, K: int, device: torch.device | str) -> QuantizedWeight:
    """A fresh random weight; distinct seeds so rotation buffers never hold the same bits."""
    return random_qweight(N, K, BITS, seed=next(_seeds), device=device)


def _path_names(qw: QuantizedWeight, M: int) -> list[str]:
    """The names of the paths escha.matmul can run for qw at M rows."""
    return [p.value for p in available_paths(qw, M)]


class EschaArm(Arm):
    """escha.matmul at one path (None: the library's default choice), or the ``escha-*`` wildcard."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.name = PREFIX if path is None else f"{PREFIX}-{path}"
        self.meta = ArmMeta(weight_bits=BITS, int_ops_per_weight=INT_OPS_PER_WEIGHT)
        self._paths_cache: dict[tuple[int, int, int], list[str]] = {}

    def weight_bits(self, N: int, K: int) -> float:
        """Exact stored bits per weight: padded trellis plus signs, scales and the global scale."""
        return QuantizedWeight.placeholder((N, K), BITS, device="meta").bits_per_weight

    def expand(self, N: int, K: int, M: int, device: torch.device | str) -> list[Arm]:
        if self.path != WILDCARD:
            return [self]
        key = (N, K, M)
        if key not in self._paths_cache:
            # Every kernel path; the reference (fp32 PyTorch through the transforms) is not one.
            self._paths_cache[key] = [p for p in _path_names(_random_qweight(N, K, device), M) if p != "reference"]
        return [EschaArm(p) for p in self._paths_cache[key]]

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> Any:
        qw = _random_qweight(N, K, device)
        if self.path is not None:
            paths = _path_names(qw, M)
            if self.path not in paths:
                raise LookupError(f"path {self.path!r} not available at M={M} (available: {paths})")
        # The gate follows the path this point runs: fp8 operands carry e4m3 rounding.
        ran = resolve_path(M, qw, self.path)
        self.meta = dataclasses.replace(self.meta, tolerance=FP8_TOLERANCE if ran.fp8_operands
                                        else DEFAULT_TOLERANCE)
        return qw

    def make_input(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(ACT_DTYPE)

    def run(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        # The default arm calls matmul exactly as users do, without naming a path.
        return escha.matmul(x, state) if self.path is None else escha.matmul(x, state, path=self.path)

    def reference(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ escha.dequantize(state).float().t()
