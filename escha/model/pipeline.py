"""quantize_model (streaming from a checkpoint directory) and quantize_module (a model in memory).

Both run the same loop: embeddings -> inputs of layer 0; then for each layer, Hessians of its
Linears from hooks, quantize them, run the quantized layer to get the next layer's inputs.
Modules after the stack (an untied lm_head, a pooler) are quantized last, from the final hidden
states. The streaming path holds one layer's weights at a time.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..format.qweight import QuantizedWeight
from ..nn.linear import EschaLinear, dense_linear, replace_linear
from .allocate import allocate_bits
from .calib import calibration_seq_len, read_calibration, text_digest, tokenize
from .checkpoint import (CheckpointReader, build_skeleton, find_layer_stack, is_tied_output,
                         load_tensors, meta_tensors, set_tensor, tie_output_embeddings)
from .engine import (Calibration, HessianCollector, Quantizer, capture_inputs, quantize_linears,
                     run_tail, target_linears)
from .errors import ModelError
from .options import LinearStats, QuantizeOptions
from .progress import Progress
from .report import QuantizeReport
from .store import PartialStore, discard_partial

TAIL = "tail"


def is_causal(model: nn.Module) -> bool:
    """Decoder-only language models are calibrated on long chunks; encoders on sentences."""
    return type(model).__name__.endswith("ForCausalLM") or bool(getattr(model.config, "is_decoder", False))


def layer_key(i: int) -> str:
    return f"layer_{i:05d}"


@dataclass
class _Run:
    """State shared by the streaming and in-memory paths."""

    model: nn.Module
    stack_name: str
    stack: nn.ModuleList
    options: QuantizeOptions
    device: torch.device
    quantizer: Quantizer
    progress: Progress
    stats: list[LinearStats] = field(default_factory=list)
    layer_seconds: dict[int, float] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    candidates: dict[str, dict[int, QuantizedWeight]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def tail_linears(self) -> list[tuple[str, nn.Linear]]:
        out = []
        for name, mod in target_linears(self.model, "", self.options.skip):
            if name.startswith(self.stack_name + "."):
                continue
            if is_tied_output(self.model, name):
                self.skipped.append(f"{name} (tied to the input embeddings)")
                continue
            out.append((name, mod))
        return out

    def install(self, linears: list[tuple[str, nn.Module]], qws: dict[str, dict[int, QuantizedWeight]],
                bits: int | dict[str, int], dense: bool) -> None:
        """Put the quantized weights (at ``bits``, or a per-name map) in place of the Linears.

        ``dense`` installs nn.Linears holding W_hat (for calibration passes); otherwise EschaLinears.
        """
        for name, mod in linears:
            k = bits if isinstance(bits, int) else bits[name]
            bias = getattr(mod, "bias", None)
            qw = qws[name][k]
            new = dense_linear(qw, bias, self.options.torch_dtype) if dense else EschaLinear.from_quantized(qw, bias)
            replace_linear(self.model, name, new)


def _target_count(model: nn.Module, stack_name: str, skip: tuple[str, ...]) -> int:
    return sum(1 for n, _ in target_linears(model, "", skip))


def _finish_bits(run: _Run) -> dict[str, int]:
    if run.options.bpw is not None:
        return allocate_bits(run.stats, run.options.bpw)
    return {s.name: int(run.options.bits) for s in run.stats}  # type: ignore[arg-type]


def _report(run: _Run, bits_map: dict[str, int], calib_info: dict, t0: float) -> QuantizeReport:
    o = run.options
    mode = f"bpw={o.bpw}" if o.bpw is not None else f"bits={o.bits}"
    if not o.use_hessian:
        hessian = "off (--no-hessian): Hessians only measure the proxy error"
    elif run.quantizer.hessian_supported:
        hessian = "used (LDLQ)"
    else:
        hessian = "fallback: the encoder refused a Hessian (quantized without)"
    if o.encoder:
        mode += f", encoder={o.encoder}"
    return QuantizeReport(mode, bits_map, run.stats, len(run.stack), run.layer_seconds, run.resumed,
                          hessian, calib_info, run.skipped, time.perf_counter() - t0)


# -- in memory ------------------------------------------------------------------------------
def quantize_module(model: nn.Module, options: QuantizeOptions | None = None, tokenizer=None,
                    texts: list[str] | None = None) -> QuantizeReport:
    """Quantize a loaded transformers model in place (its nn.Linears become EschaLinears).

    The same algorithm as ``quantize_model`` without the checkpoint streaming and resume; with
    equal options and inputs the two produce identical weights.
    """
    options = options or QuantizeOptions()
    t0 = time.perf_counter()
    device = torch.device(options.device)
    stack_name, stack = find_layer_stack(model, getattr(model.config, "num_hidden_layers", None))
    texts = texts if texts is not None else read_calibration(options.calib)
    samples = tokenize(texts, tokenizer, model.config.vocab_size, is_causal(model),
                       calibration_seq_len(model.config, options.seq_len), options.max_samples)
    progress = Progress(_target_count(model, stack_name, options.skip), "quantize", enabled=options.progress)
    run = _Run(model, stack_name, stack, options, device, Quantizer(options.use_hessian, options.encoder), progress)
    installed: list[tuple[str, nn.Module]] = []
    with torch.no_grad():
        calib = capture_inputs(model, stack[0], samples.samples, device)
        for i, layer in enumerate(stack):
            t1 = time.perf_counter()
            linears = target_linears(layer, f"{stack_name}.{i}", options.skip)
            qws, stats = _quantize_layer(run, calib, layer, linears, i)
            run.candidates.update(qws)
            run.install(linears, qws, options.propagate_bits, dense=True)
            installed += linears
            calib.advance(layer)
            run.layer_seconds[i] = time.perf_counter() - t1
        tail = run.tail_linears()
        if tail:
            qws, stats = _quantize_tail(run, calib, samples.samples, tail)
            run.candidates.update(qws)
            installed += tail
    progress.close()
    bits_map = _finish_bits(run)
    # The final modules: EschaLinears at the chosen K, keeping the original biases.
    run.install(installed, run.candidates, bits_map, dense=False)
    return _report(run, bits_map, {"source": samples.source, "samples": len(samples.samples),
                                   "tokens": samples.tokens}, t0)


def _quantize_layer(run: _Run, calib: Calibration, layer: nn.Module, linears, index: int):
    collector = HessianCollector(linears)
    try:
        calib.run(layer)
    finally:
        collector.remove()
    qws, stats = quantize_linears(linears, collector, index, run.options, run.quantizer, run.progress)
    run.stats.extend(stats)
    return qws, stats


def _quantize_tail(run: _Run, calib: Calibration, samples, tail):
    t1 = time.perf_counter()
    collector = run_tail(run.model, run.stack, calib, samples, run.device, tail)
    qws, stats = quantize_linears(tail, collector, len(run.stack), run.options, run.quantizer, run.progress)
    run.stats.extend(stats)
    run.layer_seconds[len(run.stack)] = time.perf_counter() - t1
    return qws, stats


# -- streaming from a checkpoint ------------------------------------------------------------
def _load_config(model_dir: str):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ModelError(f"{model_dir}/config.json cannot be read by transformers: {e}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")


def _load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when it ships none (calibration then uses byte tokens)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # an unreadable tokenizer: fall back to byte tokens rather than fail
        return None
    return tok if tok("calibration")["input_ids"] else None


def _to_device(module: nn.Module, prefix: str, root: nn.Module, device: torch.device) -> None:
    """Move the real (non-meta) buffers of ``module`` to ``device``."""
    for name, buf in list(module.named_buffers()):
        if buf.device.type != "meta" and buf.device != device:
            set_tensor(root, f"{prefix}.{name}" if prefix else name, buf.to(device))


def _check_out_dir(model_dir: str, out_dir: str, overwrite: bool) -> None:
    if os.path.abspath(model_dir) == os.path.abspath(out_dir):
        raise ModelError("OUT_DIR must differ from MODEL_DIR")
    if os.path.isdir(out_dir):
        present = [f for f in os.listdir(out_dir) if f != ".partial"]
        if present and not overwrite:
            raise ModelError(f"{out_dir} is not empty ({', '.join(sorted(present)[:4])}...); "
                             "choose a new directory or pass --overwrite")
        if present:
            from .output import clear_output
            clear_output(out_dir)
    os.makedirs(out_dir, exist_ok=True)


def quantize_model(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                   options: QuantizeOptions | None = None, restart: bool = False,
                   overwrite: bool = False) -> QuantizeReport:
    """Quantize a local HF safetensors checkpoint into an Escha W2 model directory.

    Streams one layer at a time (parameters of the others stay on the meta device), saves each
    finished layer to OUT_DIR/.partial/ and skips those on a rerun, then writes an HF-style
    directory: config.json with ``quantization_config``, safetensors shards, tokenizer files and
    escha_report.json. ``restart`` discards earlier partial results.
    """
    from .. import __version__
    from .output import write_output

    options = options or QuantizeOptions()
    t0 = time.perf_counter()
    model_dir, out_dir = os.fspath(model_dir), os.fspath(out_dir)
    reader = CheckpointReader(model_dir)
    config = _load_config(model_dir)
    model = build_skeleton(config)
    stack_name, stack = find_layer_stack(model, getattr(config, "num_hidden_layers", None))
    device, dtype = torch.device(options.device), options.torch_dtype
    names = list(model.state_dict().keys())
    buffers = {n for n, _ in model.named_buffers()}
    in_stack = lambda n: n.startswith(stack_name + ".")  # noqa: E731
    tied = {n + ".weight" for n, _ in model.named_modules() if n and is_tied_output(model, n)}

    shell = [n for n in names if not in_stack(n)]
    shell_keys = load_tensors(model, shell, reader, device, dtype, optional=buffers | tied)
    tie_output_embeddings(model)
    missing = [n for n in meta_tensors(model) if not in_stack(n)]
    if missing:
        raise ModelError(f"{model_dir}: checkpoint lacks {missing[:4]}")
    _to_device(model, "", model, device)  # buffers outside the stack; layer buffers move on load

    texts = read_calibration(options.calib)
    samples = tokenize(texts, _load_tokenizer(model_dir), config.vocab_size, is_causal(model),
                       calibration_seq_len(config, options.seq_len), options.max_samples)
    if restart:
        discard_partial(out_dir)
    _check_out_dir(model_dir, out_dir, overwrite)
    store = PartialStore(out_dir, options.identity({
        "model": os.path.abspath(model_dir), "calib": text_digest(texts), "escha": __version__,
        "calib_source": samples.source}))

    progress = Progress(_target_count(model, stack_name, options.skip), "quantize", enabled=options.progress)
    run = _Run(model, stack_name, stack, options, device, Quantizer(options.use_hessian, options.encoder), progress)
    with torch.no_grad():
        calib = capture_inputs(model, stack[0], samples.samples, device)
        for i in range(len(stack)):
            t1 = time.perf_counter()
            prefix = f"{stack_name}.{i}"
            layer = stack[i]
            layer_names = [n for n in names if n.startswith(prefix + ".")]
            keys = load_tensors(model, layer_names, reader, device, dtype, optional=buffers)
            _to_device(layer, prefix, model, device)
            linears = target_linears(layer, prefix, options.skip)
            if store.has(layer_key(i)):
                qws, _, stats = store.load(layer_key(i), device)
                run.stats.extend(stats)
                run.resumed.append(i)
                progress.update(len(linears), note=f"layer {i} (resumed)", skipped=True)
            else:
                qws, stats = _quantize_layer(run, calib, layer, linears, i)
                quantized = {f"{n}.weight" for n, _ in linears}
                raw = {n: reader.get(k) for n, k in keys.items() if n not in quantized}
                store.save(layer_key(i), qws, raw, stats)
            run.install(linears, qws, options.propagate_bits, dense=True)
            calib.advance(layer)
            stack[i] = layer.to("meta")  # release this layer's memory
            run.layer_seconds[i] = time.perf_counter() - t1
            if device.type == "cuda":
                torch.cuda.empty_cache()
        tail = run.tail_linears()
        if tail:
            if store.has(TAIL):
                qws, _, stats = store.load(TAIL, device)
                run.stats.extend(stats)
                run.resumed.append(len(stack))
                progress.update(len(tail), note="tail (resumed)", skipped=True)
            else:
                qws, stats = _quantize_tail(run, calib, samples.samples, tail)
                store.save(TAIL, qws, {}, stats)
    progress.close()
    bits_map = _finish_bits(run)
    report = _report(run, bits_map, {"source": samples.source, "samples": len(samples.samples),
                                     "tokens": samples.tokens, "file": options.calib}, t0)
    quantized = {f"{s.name}.weight" for s in run.stats}
    shell_raw = {n: k for n, k in shell_keys.items() if n not in quantized and n not in tied}
    write_output(out_dir, model_dir, reader, store, shell_raw, len(stack), TAIL if tail else None,
                 bits_map, report, options)
    report.total_seconds = time.perf_counter() - t0
    return report
