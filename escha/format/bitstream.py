"""Tile bitstreams: bits <-> uint32 words, and words <-> trellis states.

A tile's bitstream is 256*K bits, read MSB-first from K*8 words (bit i of the stream is bit
31 - i%32 of word i//32). The state of weight j is the 16-bit window starting at stream bit K*j,
taken cyclically (tail-biting), with the first bit of the window as the state's MSB.
Words travel as int32 tensors holding the uint32 bit pattern.
"""
from __future__ import annotations

import torch

from .spec import STATE_BITS, TILE_WEIGHTS, check_bits

_SHIFTS32 = torch.arange(31, -1, -1)


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> int32 with the same bit pattern."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32)


def words_to_u64(words: torch.Tensor) -> torch.Tensor:
    """int32 words -> int64 tensor of their unsigned values."""
    return words.to(torch.int64) & 0xFFFFFFFF


def unpack_bits(words: torch.Tensor) -> torch.Tensor:
    """Words [..., W] -> stream bits [..., 32*W] as uint8 0/1, MSB of word 0 first."""
    if words.dtype != torch.int32:
        raise TypeError(f"words must be int32 (uint32 bit patterns), got {words.dtype}")
    b = (words_to_u64(words)[..., None] >> _SHIFTS32.to(words.device)) & 1
    return b.flatten(-2).to(torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Stream bits [..., 32*W] (0/1) -> int32 words [..., W]; inverse of unpack_bits."""
    if bits.shape[-1] % 32:
        raise ValueError(f"bit count {bits.shape[-1]} is not a multiple of 32")
    b = bits.to(torch.int64)
    if b.numel() and (int(b.min()) < 0 or int(b.max()) > 1):
        raise ValueError("bits must be 0 or 1")
    u = (b.unflatten(-1, (-1, 32)) << _SHIFTS32.to(bits.device)).sum(-1)
    return _to_int32(u)


def window_index(bits: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[256, 16] stream positions of each weight's state window, MSB first, wrapped."""
    check_bits(bits)
    j = torch.arange(TILE_WEIGHTS, device=device)[:, None]
    i = torch.arange(STATE_BITS, device=device)[None, :]
    return (bits * j + i) % (TILE_WEIGHTS * bits)


def states_from_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Tile words [..., 8K] -> states [..., 256] (int32 in [0, 65535])."""
    check_bits(bits)
    if words.shape[-1] != TILE_WEIGHTS * bits // 32:
        raise ValueError(f"a K={bits} tile has {TILE_WEIGHTS * bits // 32} words, got {words.shape[-1]}")
    stream = unpack_bits(words)
    win = stream[..., window_index(bits, words.device)].to(torch.int32)  # [..., 256, 16]
    weights = 1 << torch.arange(STATE_BITS - 1, -1, -1, device=words.device, dtype=torch.int32)
    return (win * weights).sum(-1, dtype=torch.int32)


def words_from_states(states: torch.Tensor, bits: int) -> torch.Tensor:
    """States [..., 256] of a valid tail-biting walk -> tile words [..., 8K].

    Each state contributes its top K bits to the stream; the walk is checked by decoding the
    words again, and a ValueError names the first tile and position that is not a valid walk.
    """
    check_bits(bits)
    if states.shape[-1] != TILE_WEIGHTS:
        raise ValueError(f"a tile has {TILE_WEIGHTS} states, got {states.shape[-1]}")
    s = states.to(torch.int64)
    if s.numel() and (int(s.min()) < 0 or int(s.max()) >= 1 << STATE_BITS):
        raise ValueError("states must lie in [0, 65535]")
    shifts = torch.arange(STATE_BITS - 1, STATE_BITS - 1 - bits, -1, device=states.device)
    stream = ((s[..., None] >> shifts) & 1).flatten(-2)
    words = pack_bits(stream)
    bad = states_from_words(words, bits).to(torch.int64) != s
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"states are not a tail-biting trellis walk with K={bits}: first mismatch at index {where}"
        )
    return words
