"""Triton kernels for Escha W2. Every op has one shape: ``op(x, qw, *, config=None)``, a frozen
config dataclass, and a pure rule ``op_config(qw, m, device)`` that picks the config (tests and
benchmarks override it with ``dataclasses.replace``).

    decode        decode GEMM, 1..64 tokens                 DecodeConfig, decode_config
    decode_wgmma  register-operand decode GEMM (Hopper)     DecodeWgmmaConfig, decode_wgmma_config
    decode_fp8    fp8 decode GEMM, 65..256 tokens (Hopper)  DecodeFp8Config, decode_fp8_config
    prefill       fused fp8 GEMM decoding in the loop       PrefillConfig, prefill_config
    dequant_fp8   dequantize once (e4m3) + fp8 GEMM         DequantOnceConfig, dequant_once_config
    dequant_core_fp8  plain core (e4m3) + fp8 GEMM + Hn pass  DequantConfig, dequant_config(qw, device)
    core_gemm     its fp8 GEMM with Hn in the epilogue      CoreGemmConfig, core_gemm_config (from 1024 tokens)
    dequant_bf16  dequantize once (bf16) + bf16 GEMM        DequantOnceConfig, dequant_once_config
    dequant_core_bf16  plain core (bf16) + bf16 GEMM + Hn pass  DequantConfig, dequant_config(qw, device)
    actquant      activation transform (+ e4m3)             ActQuantConfig, actquant_config
    dequantize_core  the dense core T (no activations)      DequantConfig, dequant_config(qw, device)

What every kernel shares (interpreter, PTX, workspace, constants, rounding) is in ``common``.
"""
from .actquant import ActQuantConfig, actquant, actquant_config
from .codec import CodecPath, codec_path
from .core_gemm import CoreGemmConfig, core_gemm, core_gemm_config
from .decode import DecodeConfig, decode, decode_config
from .decode_fp8 import DecodeFp8Config, decode_fp8, decode_fp8_config
from .decode_wgmma import DecodeWgmmaConfig, decode_wgmma, decode_wgmma_config
from .dequant import DequantConfig, dequant_config, dequantize_core
from .dequant_once import (DequantOnceConfig, dequant_bf16, dequant_core_bf16, dequant_core_fp8, dequant_fp8,
                           dequant_once_config)
from .prefill import PrefillConfig, prefill, prefill_config
from .splitk import SplitKRule, decode_split_k

__all__ = ["ActQuantConfig", "actquant", "actquant_config", "CodecPath", "codec_path", "CoreGemmConfig", "core_gemm", "core_gemm_config", "DecodeConfig",
           "decode", "decode_config", "DecodeWgmmaConfig", "decode_wgmma", "decode_wgmma_config",
           "DecodeFp8Config", "decode_fp8", "decode_fp8_config", "DequantConfig", "dequant_config", "dequantize_core",
           "DequantOnceConfig", "dequant_bf16", "dequant_core_bf16", "dequant_core_fp8", "dequant_fp8",
           "dequant_once_config", "PrefillConfig", "prefill", "prefill_config", "SplitKRule", "decode_split_k"]
