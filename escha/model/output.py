"""Writing the quantized model directory: shards, index, config.json, tokenizer files, report."""
from __future__ import annotations

import json
import os
import shutil

import torch

from ..format.qweight import TENSOR_NAMES, QuantizedWeight
from ..format.spec import FORMAT_NAME, FORMAT_VERSION
from ..io import load_file, save_file
from ..nn.linear import EschaLinear
from .checkpoint import INDEX_NAME, CheckpointReader
from .options import QuantizeOptions
from .report import QuantizeReport
from .store import PartialStore
from .tune import norm_modules

QUANT_METHOD = "escha"
REPORT_NAME = "escha_report.json"
# Files copied from the source directory as they are.
COPY_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.json", "chat_template.jinja", "generation_config.json",
    "preprocessor_config.json",
)


def shard_name(i: int, n: int) -> str:
    """transformers' name for shard i (1-based) of n."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def quantization_config(report: QuantizeReport, options: QuantizeOptions) -> dict:
    """The ``quantization_config`` entry of config.json (read by load_model and the HfQuantizer)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "bits": options.bits,
        "bpw": round(report.mean_bits, 4),
        "storage_bpw": round(report.storage_bpw, 4),
        "bits_map": dict(sorted(report.bits_map.items())),
        "modules_to_not_convert": list(options.skip),
        "seed": options.seed,
    }


def _write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


def write_output(out_dir: str, model_dir: str, reader: CheckpointReader, store: PartialStore,
                 shell_raw: dict[str, str], num_layers: int, tail_key: str | None,
                 bits_map: dict[str, int], report: QuantizeReport, options: QuantizeOptions) -> None:
    """Assemble the finished layers into an HF-style directory, then drop the partial results.

    Shard 1 holds everything outside the layer stack (embeddings, norms, a skipped lm_head as
    plain tensors, quantized tail modules); shard i+2 holds layer i. config.json is written
    last, so a directory with a config.json is complete.
    """
    n = num_layers + 1
    weight_map: dict[str, str] = {}
    total = 0

    def write(i: int, tensors: dict) -> None:
        nonlocal total
        name = shard_name(i, n)
        path = os.path.join(out_dir, name)
        save_file(tensors, path, metadata={"format": "pt"})
        total += os.path.getsize(path)
        for key, value in tensors.items():
            parts = [f"{key}.{p}" for p in TENSOR_NAMES] if isinstance(value, QuantizedWeight) else [key]
            for p in parts:
                weight_map[p] = name

    shell = {name: reader.get(key) for name, key in shell_raw.items()}
    if tail_key is not None:
        qws, _, _ = store.load(tail_key)
        shell.update({name: by_k[bits_map[name]] for name, by_k in qws.items()})
    write(1, shell)
    del shell
    for i in range(num_layers):
        qws, raw, _ = store.load(f"layer_{i:05d}")
        tensors: dict = dict(raw)
        tensors.update({name: by_k[bits_map[name]] for name, by_k in qws.items()})
        write(i + 2, tensors)
    _write_json(os.path.join(out_dir, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
    report.output_bytes = total
    for fname in COPY_FILES:
        src = os.path.join(model_dir, fname)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, fname))
    _write_json(os.path.join(out_dir, REPORT_NAME), report.to_json())
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(report, options)
    _write_json(os.path.join(out_dir, "config.json"), config)
    store.remove()


def is_output_file(fname: str) -> bool:
    """Whether ``fname`` is one of the files write_output puts in OUT_DIR (or its temporary files)."""
    return (fname.endswith(".safetensors") or fname in COPY_FILES or fname in ("config.json", INDEX_NAME, REPORT_NAME)
            or (fname.startswith(".escha-") and fname.endswith(".tmp")) or fname.endswith(".json.tmp"))


def clear_output(out_dir: str) -> None:
    """Remove a previous model from OUT_DIR (``--overwrite``); other files are left alone."""
    for fname in os.listdir(out_dir):
        if is_output_file(fname):
            os.unlink(os.path.join(out_dir, fname))


def write_tuned(out_dir: str, model) -> int:
    """Write a tuned model's row scales and norm weights (``escha.model.tune``) back into the
    shards of OUT_DIR, each shard rewritten atomically with every other tensor as it was; plain
    tensors keep their stored dtype. Returns how many tensors changed."""
    scales = {n: m.qweight.scale for n, m in model.named_modules() if isinstance(m, EschaLinear)}
    norms = {f"{n}.weight": m.weight.detach() for n, m in norm_modules(model)}
    with open(os.path.join(out_dir, INDEX_NAME), encoding="utf-8") as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    changed = 0
    for name in shards:
        path = os.path.join(out_dir, name)
        tensors = load_file(path)
        hit = False
        for key, value in tensors.items():
            if isinstance(value, QuantizedWeight) and key in scales:
                value.scale = scales[key].to(value.scale.device, value.scale.dtype)
                value.validate()
                hit = True
                changed += 1
            elif isinstance(value, torch.Tensor) and key in norms:
                tensors[key] = norms[key].to(value.device, value.dtype)
                hit = True
                changed += 1
        if hit:
            save_file(tensors, path, metadata={"format": "pt"})
    return changed


def write_report(out_dir: str, report: QuantizeReport) -> None:
    """Rewrite OUT_DIR/escha_report.json (after scale tuning added to the report)."""
    _write_json(os.path.join(out_dir, REPORT_NAME), report.to_json())
