"""Quantizers: incoherence processing and trellis encoders."""
from .quantize import check_weight, quantize

__all__ = ["quantize", "check_weight"]
