"""The block Hadamard transform used for incoherence processing."""
from __future__ import annotations

import functools

import torch

from .spec import HAD_BLOCK


def sylvester_pm1(n: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The unnormalized Sylvester matrix, (-1)**popcount(i & j), built with device ops only (no
    host copy, so it may be built inside CUDA-graph capture). ``n`` is a power of two."""
    i = torch.arange(n, device=device, dtype=torch.int64)
    a = i[:, None] & i[None, :]
    shift = 1
    while shift < n.bit_length():  # fold the bits of i & j onto bit 0: their parity
        shift *= 2
    while shift > 1:
        shift //= 2
        a = a ^ (a >> shift)
    return (1 - 2 * (a & 1)).to(dtype)


@functools.lru_cache(maxsize=8)
def _sylvester_pm1(n: int) -> torch.Tensor:
    return sylvester_pm1(n)


def hadamard_matrix(n: int = HAD_BLOCK, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", normalized: bool = True) -> torch.Tensor:
    """Sylvester Hadamard matrix: H[i, j] = (-1)**popcount(i & j) / sqrt(n), or without the
    1/sqrt(n) when ``normalized`` is False (the exact +-1 matrix).

    The normalized matrix is symmetric and its own inverse. ``n`` must be a power of two.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = _sylvester_pm1(n)
    return (h / n**0.5 if normalized else h).to(dtype=dtype, device=device)


def block_hadamard(x: torch.Tensor, dim: int = -1, block: int = HAD_BLOCK, normalized: bool = True) -> torch.Tensor:
    """Apply blockdiag(H, H, ...) along ``dim`` (whose size must be a multiple of ``block``).

    Computed in float32 (float64 stays float64); the normalized transform is its own inverse.
    ``normalized=False`` multiplies by the exact +-1 matrix instead.
    """
    if x.shape[dim] % block:
        raise ValueError(f"dimension {dim} has size {x.shape[dim]}, not a multiple of {block}")
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    h = hadamard_matrix(block, dt, x.device, normalized)
    y = x.to(dt).movedim(dim, -1)
    y = (y.unflatten(-1, (-1, block)) @ h).flatten(-2)
    return y.movedim(-1, dim)
