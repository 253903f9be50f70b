"""Whole models: the quantize pipeline, loading, calibration text and the ``quantize`` command."""
from .calib import BUILTIN_TEXT
from .errors import ModelError, UnsupportedModelError
from .loading import load_model
from .options import LinearStats, QuantizeOptions
from .pipeline import quantize_model, quantize_module
from .report import QuantizeReport

__all__ = ["quantize_model", "quantize_module", "load_model", "QuantizeOptions", "QuantizeReport",
           "LinearStats", "ModelError", "UnsupportedModelError", "BUILTIN_TEXT"]
