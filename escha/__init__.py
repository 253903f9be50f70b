"""escha: 2-bit trellis-coded LLM weights (Escha W2), fast on GPUs.

Public API: QuantizedWeight, quantize, dequantize, matmul, save_file, load_file, codebooks.
"""
from .format import FormatError, QuantizedWeight, codebooks, dequantize, random_qweight
from .io import load_file, save_file
from .ops import DispatchRule, Path, Precision, available_paths, matmul
from .quant import quantize

__version__ = "0.1.0"
__all__ = ["QuantizedWeight", "FormatError", "codebooks", "quantize", "dequantize", "matmul",
           "save_file", "load_file", "random_qweight", "Path", "Precision", "DispatchRule",
           "available_paths", "__version__"]
