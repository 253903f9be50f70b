"""Computed codebooks: map 16-bit trellis states to fp16 values.

A codebook is registered under a name and a numeric id; the id is what files store, so a
new codebook is added by registering it under a new id, and v1 files keep decoding.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .spec import STATE_MASK


class Codebook(ABC):
    """A deterministic function from 16-bit states to float16 values."""

    name: str
    id: int

    @abstractmethod
    def values(self, states: torch.Tensor) -> torch.Tensor:
        """Map an integer tensor of states in [0, 65535] to a float16 tensor of the same shape."""

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """All 2**16 values, indexed by state."""
        return self.values(torch.arange(STATE_MASK + 1, device=device))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, id={self.id})"


def _check_states(states: torch.Tensor) -> torch.Tensor:
    if not isinstance(states, torch.Tensor):
        raise TypeError(f"states must be a torch.Tensor, got {type(states).__name__}")
    if states.dtype.is_floating_point or states.dtype.is_complex or states.dtype == torch.bool:
        raise TypeError(f"states must be an integer tensor, got {states.dtype}")
    s = states.to(torch.int64)
    if s.numel() and (int(s.min()) < 0 or int(s.max()) > STATE_MASK):
        raise ValueError("states must lie in [0, 65535]")
    return s


def u16_to_f16(u: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers in [0, 65535] as IEEE binary16 bit patterns."""
    return torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16).view(torch.float16)


class ThreeInst(Codebook):
    """3INST: an LCG, a mask/xor that pins the fp16 exponents, then the sum of the two fp16 halves."""

    name = "3inst"
    id = 0
    MUL = 89226354
    ADD = 64248484
    MASK = 0x8FFF8FFF
    XOR = 0x3B603B60

    def values(self, states: torch.Tensor) -> torch.Tensor:
        """The float16 value of each 16-bit state (any shape): the LCG, the mask/xor and the fp16 sum."""
        s = _check_states(states)
        x = (s * self.MUL + self.ADD) & 0xFFFFFFFF
        x = (x & self.MASK) ^ self.XOR
        lo = u16_to_f16(x & 0xFFFF)
        hi = u16_to_f16(x >> 16)
        # The fp32 sum of two such halves is exact (exponents differ by at most 3), so one
        # rounding to fp16 equals a native fp16 add on any hardware.
        return (lo.float() + hi.float()).to(torch.float16)


_REGISTRY: dict[str, Codebook] = {}
_BY_ID: dict[int, Codebook] = {}


def register(codebook: Codebook) -> Codebook:
    """Add a codebook to the registry; its name and id must both be new."""
    if codebook.name in _REGISTRY or codebook.id in _BY_ID:
        raise ValueError(f"codebook name {codebook.name!r} or id {codebook.id} is already registered")
    _REGISTRY[codebook.name] = codebook
    _BY_ID[codebook.id] = codebook
    return codebook


def get(key: str | int) -> Codebook:
    """Look a codebook up by name (``"3inst"``) or by its file id (``0``)."""
    table = _BY_ID if isinstance(key, int) and not isinstance(key, bool) else _REGISTRY
    try:
        return table[key]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown codebook {key!r}; known: {sorted(_REGISTRY)} (ids {sorted(_BY_ID)})"
        ) from None


def names() -> list[str]:
    """Names of all registered codebooks."""
    return sorted(_REGISTRY)


register(ThreeInst())
