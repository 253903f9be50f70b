"""GEMM shapes and token counts measured by ``escha bench``."""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """One weight matrix: y[M, N] = x[M, K] @ W[N, K]^T."""

    name: str
    N: int
    K: int

    def __str__(self) -> str:
        return self.name


# Qwen3-14B at tensor-parallel 2: the shapes of the founding tuning report.
NAMED_SHAPES: dict[str, Shape] = {
    "gate_up": Shape("gate_up", 17408, 5120),
    "down": Shape("down", 5120, 8704),
}
DEFAULT_SHAPES: tuple[str, ...] = ("gate_up", "down")
DEFAULT_MS: tuple[int, ...] = (1, 8, 40, 64, 512, 2048, 8192)

# M at or below this is "decode" (GEMV-like); at or above PREFILL_MIN_M it is "prefill".
DECODE_MAX_M = 64
PREFILL_MIN_M = 128

_CUSTOM = re.compile(r"^(?P<name>[A-Za-z0-9_\-]+?)x(?P<n>\d+)x(?P<k>\d+)$")


def parse_shape(text: str) -> Shape:
    """A named shape (``gate_up``) or a custom ``NAMExNxK`` (``qkvx7168x5120``)."""
    text = text.strip()
    if text in NAMED_SHAPES:
        return NAMED_SHAPES[text]
    m = _CUSTOM.match(text)
    if not m:
        known = ", ".join(NAMED_SHAPES)
        raise ValueError(f"bad shape {text!r}: use one of {known} or NAMExNxK (e.g. projx4096x5120)")
    n, k = int(m["n"]), int(m["k"])
    if n < 1 or k < 1:
        raise ValueError(f"bad shape {text!r}: N and K must be positive")
    return Shape(m["name"], n, k)


def parse_shapes(text: str) -> list[Shape]:
    """Comma-separated shapes; duplicate names are refused so rows stay unambiguous."""
    shapes = [parse_shape(t) for t in text.split(",") if t.strip()]
    if not shapes:
        raise ValueError("no shapes given")
    names = [s.name for s in shapes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate shape names in {text!r}")
    return shapes


def parse_ms(text: str) -> list[int]:
    """Comma-separated positive token counts, kept in the given order without duplicates."""
    out: list[int] = []
    for t in text.split(","):
        t = t.strip()
        if not t:
            continue
        try:
            m = int(t)
        except ValueError:
            raise ValueError(f"bad M {t!r}: must be an integer") from None
        if m < 1:
            raise ValueError(f"bad M {m}: must be >= 1")
        if m not in out:
            out.append(m)
    if not out:
        raise ValueError("no M values given")
    return out
