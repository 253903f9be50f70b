"""Errors raised by the model pipeline; each message names the file, tensor or setting at fault."""
from __future__ import annotations


class ModelError(ValueError):
    """A checkpoint, configuration or option that the pipeline cannot use."""


class UnsupportedModelError(ModelError):
    """An architecture the layer-by-layer pipeline cannot handle."""
