"""Constants of the Escha W2 format, version 1 (docs/FORMAT.md is the normative text)."""
from __future__ import annotations

FORMAT_NAME = "escha-w2"
FORMAT_VERSION = 1

STATE_BITS = 16  # L: trellis state width
STATE_MASK = (1 << STATE_BITS) - 1
TILE = 16  # a tile is TILE x TILE weights
TILE_WEIGHTS = TILE * TILE  # one tail-biting sequence
HAD_BLOCK = 128  # block size of the Hadamard transform on both sides
SUPPORTED_BITS = (1, 2, 3, 4)  # K, bits per weight


def words_per_tile(bits: int) -> int:
    """uint32 words holding one tile's 256*K-bit cyclic bitstream."""
    check_bits(bits)
    return TILE_WEIGHTS * bits // 32


def check_bits(bits: object) -> int:
    """Return ``bits`` if it is a supported K, else raise ValueError naming it."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits!r}")
    return bits


def padded(n: int) -> int:
    """Dimension after padding to a whole number of Hadamard blocks (which are whole tiles)."""
    return -(-n // HAD_BLOCK) * HAD_BLOCK
