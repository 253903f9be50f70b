"""transformers integration: ``from_pretrained`` of a directory written by ``escha quantize``.

Importing this module registers the "escha" quantization method with transformers'
quantizer registry (``register_quantization_config`` / ``register_quantizer``), after which

    import escha.integrations.hf
    model = AutoModelForCausalLM.from_pretrained(out_dir)

builds the model on meta, replaces the quantized nn.Linears by EschaLinear and lets transformers
load the shards into their buffers. Tested with transformers 5.x.
"""
from __future__ import annotations

from typing import Any

from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                          register_quantization_config, register_quantizer)
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..format.spec import FORMAT_NAME, FORMAT_VERSION
from ..model.loading import install_escha_linears
from ..model.output import QUANT_METHOD


class EschaConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of an Escha W2 model (see escha.model.output.quantization_config)."""

    def __init__(self, bits_map: dict[str, int] | None = None, bits: int | None = None,
                 bpw: float | None = None, modules_to_not_convert: list[str] | None = None,
                 format: str = FORMAT_NAME, version: int = FORMAT_VERSION, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        self.bits_map = dict(bits_map or {})
        self.bits = bits
        self.bpw = bpw
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.format = format
        self.version = version
        for k, v in kwargs.items():  # keep unknown fields (storage_bpw, seed...) for round trips
            if k != "quant_method":
                setattr(self, k, v)
        if self.format != FORMAT_NAME:
            raise ValueError(f"quantization_config format {self.format!r} is not {FORMAT_NAME!r}")
        if not isinstance(self.version, int) or self.version > FORMAT_VERSION:
            raise ValueError(f"format version {self.version!r} is newer than this escha supports "
                             f"({FORMAT_VERSION}); upgrade escha")


class EschaHfQuantizer(HfQuantizer):
    """Loads pre-quantized Escha W2 checkpoints; quantizing on the fly is done by ``escha quantize``."""

    requires_calibration = True
    quantization_config: EschaConfig

    def _process_model_before_weight_loading(self, model, **kwargs):
        install_escha_linears(model, self.quantization_config.bits_map, device="meta")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        from ..nn import fuse_projections
        fuse_projections(model)  # projections quantized over one input as one product, norms folded in
        return model

    def is_serializable(self, safe_serialization: bool | None = None) -> bool:
        """Always True: transformers may save a loaded model with ``save_pretrained``."""
        return True

    @property
    def is_compileable(self) -> bool:
        """Always True: ``escha.matmul`` is a custom op with a fake implementation that CUDA graphs
        capture, so transformers may compile the decode step, as it does for
        ``generate(..., cache_implementation="static")``."""
        return True

    @property
    def is_trainable(self) -> bool:
        """Always False: transformers does not train the loaded model (its quantized weights are buffers)."""
        return False


def register() -> None:
    """Register the config and quantizer under "escha" (idempotent)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(EschaConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(EschaHfQuantizer)


register()
