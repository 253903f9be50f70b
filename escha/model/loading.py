"""load_model: an Escha W2 model directory -> a transformers model with EschaLinear layers."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..devices import resolve_device
from ..format.qweight import QuantizedWeight
from ..format.spec import check_bits
from ..io import load_file
from ..nn.linear import EschaLinear, replace_linear
from .checkpoint import (INDEX_NAME, build_skeleton, meta_tensors, set_tensor, tie_output_embeddings)
from .errors import ModelError
from .output import QUANT_METHOD


def read_config_json(model_dir: str) -> dict:
    """The JSON object in ``model_dir``/config.json; a missing directory or file raises
    FileNotFoundError, a file that is not a JSON object ModelError, each naming it."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir} has no config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path} must hold a JSON object, got a {type(config).__name__}")
    return config


def read_quantization_config(model_dir: str) -> dict:
    """config.json's ``quantization_config``, checked to be an Escha one with a valid bits_map."""
    path = os.path.join(model_dir, "config.json")
    qc = read_config_json(model_dir).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != QUANT_METHOD:
        raise ModelError(f"{path} has no escha quantization_config (was the model made by `escha quantize`?)")
    if not isinstance(qc.get("bits_map"), dict):
        raise ModelError(f"{path}: quantization_config has no bits_map")
    for name, bits in qc["bits_map"].items():
        try:
            check_bits(bits)
        except ValueError as e:
            raise ModelError(f"{path}: quantization_config.bits_map[{name!r}]: {e}") from None
    return qc


def install_escha_linears(model: nn.Module, bits_map: dict[str, int], device: torch.device | str = "meta",
                          dtype: torch.dtype | None = None) -> None:
    """Replace each nn.Linear named in ``bits_map`` by an EschaLinear of the same shape."""
    for name, bits in bits_map.items():
        try:
            old = model.get_submodule(name)
        except AttributeError:
            raise ModelError(f"quantization_config names {name!r}, which the model does not have") from None
        if not isinstance(old, (nn.Linear, EschaLinear)):
            raise ModelError(f"{name} is a {type(old).__name__}, not a Linear")
        has_bias = getattr(old, "bias", None) is not None
        bias_dtype = dtype or (old.bias.dtype if has_bias else None)
        replace_linear(model, name, EschaLinear(old.in_features, old.out_features, bias=has_bias,
                                                bits=int(bits), device=device, dtype=bias_dtype))


def _shards(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                data = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelError(f"{index} is not valid JSON ({e})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelError(f"{index} has no \"weight_map\" object of tensor names to shard file names")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir} has no model.safetensors or {INDEX_NAME}")
    missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
    if missing:
        raise FileNotFoundError(f"{model_dir}: missing shard(s) {', '.join(missing)}")
    return [os.path.join(model_dir, f) for f in files]


def escha_skeleton(model_dir: str, dtype: torch.dtype | None) -> nn.Module:
    """The model of an escha checkpoint on the meta device, its quantized Linears already
    EschaLinears at their K, in ``dtype`` (None: the config's)."""
    from transformers import AutoConfig

    qc = read_quantization_config(model_dir)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = build_skeleton(config, dtype)
    install_escha_linears(model, qc["bits_map"], device="meta", dtype=dtype)
    return model


def check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a floating torch.dtype (a name such as "bfloat16" is accepted, as in
    QuantizeOptions.dtype), or None; anything else raises TypeError or ModelError naming it."""
    if dtype is None:
        return None
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(dt, torch.dtype):
        if isinstance(dtype, str):
            raise ModelError(f"dtype must name a torch floating dtype (e.g. 'bfloat16'), got {dtype!r}")
        raise TypeError(f"dtype must be a torch.dtype, a name such as 'bfloat16', or None; "
                        f"got {type(dtype).__name__}")
    if not dt.is_floating_point:
        raise ModelError(f"dtype must be a floating dtype, got {dt}")
    return dt


def load_model(model_dir: str | os.PathLike, device: torch.device | str | None = None,
               dtype: torch.dtype | str | None = None, tensor_parallel: bool | None = None) -> nn.Module:
    """Load a directory written by ``escha quantize`` as a transformers model (eval mode).

    The model is built with meta parameters, its quantized Linears replaced by EschaLinear, then
    filled shard by shard. ``device``: None puts it on CUDA when torch sees a GPU (the current
    device), else on the CPU; a device this torch cannot use raises escha.devices.DeviceError
    (one line). Plain tensors take ``dtype`` (default: the config's dtype, else float32); the
    Escha buffers keep the format's dtypes; a name ("bfloat16") is accepted for ``dtype``. A
    directory that is missing or not written by ``escha quantize`` raises FileNotFoundError or
    ModelError, one line naming the file. ``.generate`` works for causal LMs.
    Inside an initialised torch.distributed group of several ranks (``tensor_parallel`` None or
    True), each rank loads only its tensor-parallel shards (``escha.parallel``).
    """
    from ..parallel import load_model_parallel, tensor_parallel_active
    dtype = check_dtype(dtype)
    if tensor_parallel or (tensor_parallel is None and tensor_parallel_active()):
        # The device is resolved inside the ranks' agreement, so a bad one fails every rank.
        return load_model_parallel(model_dir, device, dtype)

    return finish(load_unfused(model_dir, device, dtype), model_dir)


def load_unfused(model_dir: str | os.PathLike, device: torch.device | str | None = None,
                 dtype: torch.dtype | str | None = None) -> nn.Module:
    """``load_model`` on one process without its last step (``finish``): every quantized Linear an
    EschaLinear of its own, the norms as modules of the model, the model in training mode. What
    scale tuning (``escha.model.tune``) trains, and writes back to the directory."""
    model_dir, dtype = os.fspath(model_dir), check_dtype(dtype)
    device = resolve_device(device)
    model = escha_skeleton(model_dir, dtype)
    expected = set(model.state_dict().keys())
    for path in _shards(model_dir):
        for name, value in load_file(path, device).items():
            if isinstance(value, QuantizedWeight):
                quantized_target(model, path, name, value.bits).set_qweight(value)
            else:
                check_belongs(model, expected, path, name)
                set_tensor(model, name, in_dtype(value, dtype))
    check_complete(model, model_dir)
    return model.to(device)  # buffers built on CPU (rotary tables, position ids)


def quantized_target(model: nn.Module, path: str, name: str, bits: int) -> EschaLinear:
    """The EschaLinear that the quantized weight ``name`` (K = ``bits``) of shard ``path`` fills."""
    mod = model.get_submodule(name) if _has_module(model, name) else None
    if not isinstance(mod, EschaLinear):
        raise ModelError(f"{path}: {name!r} is quantized but the model has no EschaLinear there")
    if mod.bits != bits:
        raise ModelError(f"{path}: {name!r} has K={bits}, config says K={mod.bits}")
    return mod


def check_belongs(model: nn.Module, expected: set[str], path: str, name: str) -> None:
    """A stored plain tensor must be one of the model's (``expected``: its state-dict names)."""
    if name not in expected:
        raise ModelError(f"{path}: tensor {name!r} does not belong to {type(model).__name__}")


def in_dtype(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A stored plain tensor as the model holds it: floats in ``dtype``, integers as stored."""
    return value.to(dtype) if value.is_floating_point() else value


def check_complete(model: nn.Module, model_dir: str) -> None:
    """Tie the output embedding where the config says so; then no tensor may be left on meta."""
    tie_output_embeddings(model)
    missing = meta_tensors(model)
    if missing:
        raise ModelError(f"{model_dir}: the shards lack {len(missing)} tensor(s), e.g. {missing[:4]}")


def finish(model: nn.Module, model_dir: str) -> nn.Module:
    """The loaded model in eval mode, with the directory's generation config if it has one, its
    EschaLinears that were quantized over one input grouped to run as one product
    (``escha.nn.share_inputs``), and the RMSNorms around them folded into them
    (``escha.nn.fuse_projections``)."""
    from transformers import GenerationConfig

    from ..nn import fuse_projections
    fuse_projections(model)

    gen = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen) and hasattr(model, "generation_config"):
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model.eval()


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False
