"""Triton kernels for Escha W2: the 3INST codec, dequant, transforms and the decode GEMM."""
from .codec import Ablation, CodecPath
from .decode import DecodeConfig, decode_config, decode_matmul
from .dequant import FP8_SCALE, dequantize_core
from .splitk import SplitKRule, decode_split_k
from .transforms import hadamard_input, hadamard_output

__all__ = ["Ablation", "CodecPath", "DecodeConfig", "decode_config", "decode_matmul", "FP8_SCALE",
           "dequantize_core", "SplitKRule", "decode_split_k", "hadamard_input", "hadamard_output"]
