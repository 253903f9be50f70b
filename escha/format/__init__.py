"""The Escha W2 format: spec constants, codebooks, bitstreams and the reference codec."""
from . import codebooks
from .bitstream import pack_bits, states_from_words, unpack_bits, words_from_states
from .codec import (decode_tiles, decode_trellis, dequantize, input_transform, matmul_reference,
                    output_transform, row_scale)
from .hadamard import block_hadamard, hadamard_matrix
from .qweight import FormatError, QuantizedWeight
from .random import random_qweight
from .shard import ShardError, supported_degrees
from .spec import FORMAT_NAME, FORMAT_VERSION, HAD_BLOCK, SUPPORTED_BITS, TILE, padded, words_per_tile

__all__ = [
    "codebooks", "pack_bits", "unpack_bits", "states_from_words", "words_from_states",
    "decode_tiles", "decode_trellis", "dequantize", "input_transform", "output_transform",
    "matmul_reference", "row_scale", "block_hadamard", "hadamard_matrix", "FormatError",
    "QuantizedWeight", "random_qweight", "FORMAT_NAME", "FORMAT_VERSION", "HAD_BLOCK",
    "SUPPORTED_BITS", "TILE", "padded", "words_per_tile", "ShardError", "supported_degrees",
]
