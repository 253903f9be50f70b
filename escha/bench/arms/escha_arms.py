"""escha's own matmul, at its default path (``escha``) and at each named path (``escha-<path>``).

Interface used (built elsewhere in the package):
    escha.format.random_qweight(out, in, bits, device=...) -> QuantizedWeight with random trellis bits
    escha.dequantize(qw) -> float32 [out, in]
    escha.matmul(x, qw, path=None) -> [M, out]
    escha.ops.available_paths(qw, M) -> list[str]   (optional; without it only ``escha`` runs)
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
from typing import Any

import torch

from .base import DEFAULT_TOLERANCE, Arm, ArmMeta

# Paths whose GEMM operands are fp8 e4m3 (3 mantissa bits): their relative error is ~4e-2
# (docs/KERNELS.md, prefill tolerance table), so their gate is wider than the 16-bit paths'.
FP8_PATHS = ("prefill", "dequant-fp8")
FP8_TOLERANCE = 8e-2

BITS = 2
# Integer ops per weight of the trellis codec; the codec floor's default when escha.ops
# does not report one for a path.
DEFAULT_INT_OPS_PER_WEIGHT = 5.0
ACT_DTYPE = torch.float16  # the codec computes in half2
WILDCARD = "*"
PREFIX = "escha"


def _module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def _int_ops_for(path: str | None) -> float:
    """escha.ops.INT_OPS_PER_WEIGHT[path] when the ops module publishes it, else the default."""
    table = getattr(_module("escha.ops"), "INT_OPS_PER_WEIGHT", None)
    if not isinstance(table, dict):
        return DEFAULT_INT_OPS_PER_WEIGHT
    # Keys may be path enums; compare by name (an enum's hash is not its value's).
    by_name = {(None if k is None else str(getattr(k, "value", k))): float(v) for k, v in table.items()}
    return by_name.get(path, by_name.get(None, DEFAULT_INT_OPS_PER_WEIGHT))


_seeds = itertools.count(1)


def _random_qweight(N: int, K: int, device: torch.device | str) -> Any:
    """A fresh random weight; distinct seeds so rotation buffers never hold the same bits."""
    fn = _module("escha.format").random_qweight
    if "seed" in inspect.signature(fn).parameters:
        return fn(N, K, BITS, seed=next(_seeds), device=device)
    return fn(N, K, BITS, device=device)


def available_paths(qw: Any, M: int) -> list[str] | None:
    """escha.ops.available_paths(qw, M), or None when escha does not expose it."""
    fn = getattr(_module("escha.ops"), "available_paths", None)
    return None if fn is None else [str(getattr(p, "value", p)) for p in fn(qw, M)]


class EschaArm(Arm):
    """escha.matmul at one path (None: the library's default choice), or the ``escha-*`` wildcard."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.name = PREFIX if path is None else f"{PREFIX}-{path}"
        self.meta = ArmMeta(weight_bits=BITS, int_ops_per_weight=_int_ops_for(path))
        self._paths_cache: dict[tuple[int, int, int], list[str] | None] = {}

    def unavailable(self) -> str | None:
        escha = _module("escha")
        fmt = _module("escha.format")
        missing = [n for n, ok in (("escha.matmul", hasattr(escha, "matmul")),
                                   ("escha.dequantize", hasattr(escha, "dequantize")),
                                   ("escha.format.random_qweight", hasattr(fmt, "random_qweight")))
                   if not ok]
        return f"missing {', '.join(missing)}" if missing else None

    def weight_bits(self, N: int, K: int) -> float:
        """Exact stored bits per weight: padded trellis plus signs, scales and the global scale."""
        spec = _module("escha.format.spec")
        if spec is None:
            return float(BITS)
        np_, kp = spec.padded(N), spec.padded(K)
        bits = np_ * kp * BITS + 8 * (np_ + kp) + 16 * np_ + 32
        return bits / (N * K)

    def expand(self, N: int, K: int, M: int, device: torch.device | str) -> list[Arm]:
        if self.path != WILDCARD:
            return [self]
        key = (N, K, M)
        if key not in self._paths_cache:
            qw = _random_qweight(N, K, device)
            self._paths_cache[key] = available_paths(qw, M)
        paths = self._paths_cache[key]
        return [EschaArm(p) for p in (paths or [])]

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> Any:
        qw = _random_qweight(N, K, device)
        if self.path is not None:
            paths = available_paths(qw, M)
            if paths is not None and self.path not in paths:
                raise LookupError(f"path {self.path!r} not available at M={M} (available: {paths})")
        # The gate follows the path this point runs: fp8 operands carry e4m3 rounding.
        resolve = getattr(_module("escha.ops"), "resolve_path", None)
        ran = str(resolve(M, qw.device, qw.codebook_id, self.path)) if resolve else str(self.path)
        self.meta = dataclasses.replace(self.meta, tolerance=FP8_TOLERANCE if ran in FP8_PATHS
                                        else DEFAULT_TOLERANCE)
        return qw

    def make_input(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        return x.to(ACT_DTYPE)

    def run(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        matmul = _module("escha").matmul
        # The default arm calls matmul exactly as users do, without naming a path.
        return matmul(x, state) if self.path is None else matmul(x, state, path=self.path)

    def reference(self, state: Any, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ _module("escha").dequantize(state).float().t()
