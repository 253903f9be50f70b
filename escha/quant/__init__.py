"""Quantizers: incoherence processing, scale search, LDLQ and the tail-biting Viterbi encoder."""
from .encode import EncodeOptions, encode_tiles
from .estimate import estimate_seconds
from .ldlq import proxy_loss
from .quantize import Encoder, check_encoder, check_weight, quantize, quantize_shared, tile_count
from .scale import ScaleSearch

__all__ = ["quantize", "quantize_shared", "check_weight", "check_encoder", "Encoder", "EncodeOptions", "ScaleSearch",
           "encode_tiles", "proxy_loss", "estimate_seconds", "tile_count"]
