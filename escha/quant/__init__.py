"""Quantizers: incoherence processing, scale search, LDLQ and the tail-biting Viterbi encoder."""
from .encode import EncodeOptions, encode_tiles, stderr_progress
from .estimate import estimate_seconds
from .ldlq import proxy_loss
from .quantize import Encoder, check_weight, quantize
from .scale import ScaleSearch

__all__ = ["quantize", "check_weight", "Encoder", "EncodeOptions", "ScaleSearch", "encode_tiles",
           "stderr_progress", "proxy_loss", "estimate_seconds"]
