"""escha: 2-bit trellis-coded LLM weights (Escha W2), fast on GPUs.

Public API: QuantizedWeight, quantize, dequantize, matmul, save_file, load_file, codebooks;
models: EschaLinear, quantize_model, load_model (``import escha.integrations.hf`` registers the
transformers quantizer, so that AutoModelForCausalLM.from_pretrained reads escha checkpoints).
"""
from .format import FormatError, QuantizedWeight, codebooks, dequantize, random_qweight
from .io import load_file, save_file
from .model import load_model, quantize_model
from .nn import EschaLinear
from .norm import RowNorm
from .ops import DispatchRule, KernelPath, Precision, available_paths, matmul
from .quant import quantize

__version__ = "0.1.0"
__all__ = ["QuantizedWeight", "FormatError", "codebooks", "quantize", "dequantize", "matmul",
           "save_file", "load_file", "random_qweight", "KernelPath", "Precision", "DispatchRule",
           "available_paths", "load_model", "quantize_model", "EschaLinear", "RowNorm", "__version__"]
