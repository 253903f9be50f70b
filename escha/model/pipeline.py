"""quantize_model (streaming from a checkpoint directory) and quantize_module (a model in memory).

Both run one loop (``_quantize_stack``) over a source of layers: embeddings -> inputs of layer 0;
then for each layer, Hessians of its Linears from hooks, quantize them, run the quantized layer
to get the next layer's inputs. Modules after the stack (an untied lm_head, a pooler) are
quantized last, from the final hidden states. The sources differ only in where a layer's weights
come from and where its results go: ``InMemory`` keeps them, ``Streamed`` loads each layer from
the checkpoint, resumes or saves it under OUT_DIR/.partial/ and releases it, so it holds one
layer's weights at a time.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from tqdm import tqdm

from ..devices import model_device, resolve_device
from ..format.qweight import QuantizedWeight
from ..nn.linear import EschaLinear, dense_linear, replace_linear
from ..nn.norms import fuse_projections
from ..progress import SlowWorkWarning, bar, format_seconds
from ..quant import estimate_seconds, tile_count
from ..quant.quantize import SLOW_SECONDS
from .allocate import allocate_bits
from .calib import calibration_seq_len, read_calibration, text_digest, tokenize
from .checkpoint import (CheckpointReader, build_skeleton, find_layer_stack, is_tied_output,
                         load_tensors, meta_tensors, set_tensor, tie_output_embeddings)
from .engine import (Calibration, HessianCollector, capture_inputs, quantize_linears, run_tail, skip_matches,
                     target_linears)
from .errors import ModelError
from .options import DEFAULT_SKIP, LinearStats, QuantizeOptions, options_or_default
from .report import QuantizeReport
from .store import PARTIAL_DIR, PartialStore, discard_partial
from .tune import DEFAULT_STEPS, TunePlan, plan, result_json, tune_directory

TAIL = "tail"
GPU_SLOW_SECONDS = 600.0  # on a GPU, runs estimated longer than this are announced
Candidates = dict[str, dict[int, QuantizedWeight]]  # Linear name -> K -> its quantized weight


def is_causal(model: nn.Module) -> bool:
    """Decoder-only language models are calibrated on long chunks; encoders on sentences."""
    return type(model).__name__.endswith("ForCausalLM") or bool(getattr(model.config, "is_decoder", False))


def layer_key(i: int) -> str:
    """The partial-results key of layer i of the stack."""
    return f"layer_{i:05d}"


@dataclass
class _Run:
    """State of one quantization run, whichever the source of layers."""

    model: nn.Module
    stack_name: str
    stack: nn.ModuleList
    options: QuantizeOptions
    device: torch.device
    progress: tqdm  # counts tiles, every candidate K: tile_count(shape) * len(options.candidates)
    stats: list[LinearStats] = field(default_factory=list)
    layer_seconds: dict[int, float] = field(default_factory=dict)
    resumed: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def tail_linears(self) -> list[tuple[str, nn.Linear]]:
        """The Linears after the stack to quantize (tied output embeddings are skipped, and noted)."""
        out = []
        for name, mod in target_linears(self.model, "", self.options.skip):
            if name.startswith(self.stack_name + "."):
                continue
            if is_tied_output(self.model, name):
                self.skipped.append(f"{name} (tied to the input embeddings)")
                continue
            out.append((name, mod))
        return out

    def install(self, linears: list[tuple[str, nn.Module]], qws: Candidates, bits: int | dict[str, int],
                dense: bool) -> None:
        """Put the quantized weights (at ``bits``, or a per-name map) in place of the Linears.

        ``dense`` installs nn.Linears holding W_hat (for calibration passes); otherwise EschaLinears.
        """
        for name, mod in linears:
            k = bits if isinstance(bits, int) else bits[name]
            bias = getattr(mod, "bias", None)
            qw = qws[name][k]
            new = dense_linear(qw, bias, self.options.torch_dtype) if dense else EschaLinear.from_quantized(qw, bias)
            replace_linear(self.model, name, new)


class InMemory:
    """Layers of a model already in memory: nothing to load or release; results are kept."""

    def __init__(self) -> None:
        self.candidates: Candidates = {}
        self.linears: list[tuple[str, nn.Module]] = []  # every quantized Linear, with its original module

    def load(self, prefix: str, layer: nn.Module) -> None:
        """Make the layer at ``prefix`` ready to run (it already is)."""

    def resume(self, key: str) -> tuple[Candidates, list[LinearStats]] | None:
        """Results stored by an earlier run (never, in memory)."""
        return None

    def keep(self, key: str, linears: list[tuple[str, nn.Module]], qws: Candidates,
             stats: list[LinearStats]) -> None:
        """Hold a layer's results until the final bits are known."""
        self.candidates.update(qws)
        self.linears += linears

    def release(self, stack: nn.ModuleList, index: int) -> None:
        """Free layer ``index`` once the next layer's inputs exist (kept, in memory)."""


class Streamed:
    """Layers streamed from a checkpoint: loaded one at a time, resumed from or saved to the
    partial store, then moved back to the meta device."""

    def __init__(self, model: nn.Module, reader: CheckpointReader, store: PartialStore,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.reader, self.store, self.device, self.dtype = model, reader, store, device, dtype
        self.names = list(model.state_dict().keys())
        self.buffers = {n for n, _ in model.named_buffers()}
        self.keys: dict[str, str] = {}  # the current layer's tensor names -> checkpoint keys

    def load(self, prefix: str, layer: nn.Module) -> None:
        """Read the tensors of the layer at ``prefix`` from the checkpoint onto the device."""
        layer_names = [n for n in self.names if n.startswith(prefix + ".")]
        self.keys = load_tensors(self.model, layer_names, self.reader, self.device, self.dtype,
                                 optional=self.buffers)
        _to_device(layer, prefix, self.model, self.device)

    def resume(self, key: str) -> tuple[Candidates, list[LinearStats]] | None:
        """The stored results of ``key`` if an earlier run of the same identity finished it."""
        if not self.store.has(key):
            return None
        qws, _, stats = self.store.load(key, self.device)
        return qws, stats

    def keep(self, key: str, linears: list[tuple[str, nn.Module]], qws: Candidates,
             stats: list[LinearStats]) -> None:
        """Save a finished layer (its quantized Linears, its other tensors as stored, its stats)."""
        quantized = {f"{n}.weight" for n, _ in linears}
        raw = {n: self.reader.get(k) for n, k in self.keys.items() if n not in quantized}
        self.store.save(key, qws, raw, stats)

    def release(self, stack: nn.ModuleList, index: int) -> None:
        """Move layer ``index`` back to the meta device: one layer's weights in memory at a time."""
        self.keys = {}  # what follows the stack (the tail) owns no layer tensors
        stack[index] = stack[index].to("meta")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _quantize_stack(run: _Run, calib: Calibration, samples: list[torch.Tensor],
                    source: InMemory | Streamed) -> bool:
    """Quantize every layer of the stack, then the modules after it; returns whether there were any."""

    def results(key: str, linears, quantize, index: int) -> Candidates:
        """The stored results of ``key`` if the source has them, else ``quantize()``'s, kept."""
        stored = source.resume(key)
        if stored is not None:
            qws, stats = stored
            run.resumed.append(index)
            # Resumed work leaves the bar's total, so that its rate and time left count new work only.
            run.progress.total -= _tiles(linears, run.options)
            run.progress.set_postfix_str(f"{len(run.resumed)} layer(s) resumed", refresh=True)
        else:
            qws, stats = quantize()
            source.keep(key, linears, qws, stats)
        run.stats.extend(stats)
        return qws

    for i in range(len(run.stack)):
        t1 = time.perf_counter()
        prefix = f"{run.stack_name}.{i}"
        layer = run.stack[i]
        source.load(prefix, layer)
        linears = target_linears(layer, prefix, run.options.skip)
        qws = results(layer_key(i), linears, lambda: _quantize_layer(run, calib, layer, linears, i), i)
        run.install(linears, qws, run.options.propagate_bits, dense=True)
        calib.advance(layer)
        source.release(run.stack, i)
        run.layer_seconds[i] = time.perf_counter() - t1
    tail = run.tail_linears()
    if tail:
        t1 = time.perf_counter()
        results(TAIL, tail, lambda: _quantize_tail(run, calib, samples, tail), len(run.stack))
        run.layer_seconds[len(run.stack)] = time.perf_counter() - t1
    return bool(tail)


def _quantize_layer(run: _Run, calib: Calibration, layer: nn.Module, linears, index: int):
    collector = HessianCollector(linears)
    try:
        calib.run(layer)
    finally:
        collector.remove()
    return quantize_linears(linears, collector, index, run.options, run.progress)


def _quantize_tail(run: _Run, calib: Calibration, samples, tail):
    collector = run_tail(run.model, run.stack, calib, samples, run.device, tail)
    return quantize_linears(tail, collector, len(run.stack), run.options, run.progress)


def _weight_tiles(linears: list[tuple[str, nn.Module]]) -> int:
    """Tiles (16 x 16 weights, after padding) of these Linears' weights."""
    return sum(tile_count(tuple(m.weight.shape)) for _, m in linears)


def _tiles(linears: list[tuple[str, nn.Module]], options: QuantizeOptions) -> int:
    """Tiles the encoder processes for these Linears: every tile once per candidate K."""
    return _weight_tiles(linears) * len(options.candidates)


def quantization_targets(model: nn.Module, options: QuantizeOptions) -> list[tuple[str, nn.Module]]:
    """Every Linear the run quantizes (the tied output embedding is left as it is)."""
    return [(n, m) for n, m in target_linears(model, "", options.skip) if not is_tied_output(model, n)]


def quantization_device(model: nn.Module, options: QuantizeOptions) -> torch.device:
    """Where an in-memory model is quantized: ``options.device``, else where the model is."""
    return resolve_device(options.device) if options.device is not None else model_device(model)


def _warn_unmatched_skip(model: nn.Module, options: QuantizeOptions) -> None:
    """Warn about each skip pattern of the user's that matches no Linear (a typo skips nothing)."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for pattern in options.skip:
        if pattern not in DEFAULT_SKIP and not any(skip_matches(n, (pattern,)) for n in names):
            warnings.warn(f"skip pattern {pattern!r} matches no Linear of {type(model).__name__} "
                          f"(e.g. {names[0] if names else 'none'})", UserWarning, stacklevel=3)


def _notice_if_slow(linears: list[tuple[str, nn.Module]], options: QuantizeOptions, device: torch.device) -> None:
    """A SlowWorkWarning before encoding that the measured rates say will take long: over a
    minute on a CPU (pointing to a GPU), over GPU_SLOW_SECONDS on a GPU (the H200's rate)."""
    if options.encoder == "greedy" or not linears:
        return
    tiles = _weight_tiles(linears)
    gpu = sum(estimate_seconds(tiles, k, "cuda") for k in options.candidates)
    work = f"encoding {len(linears)} Linears ({tiles:,} tiles at K={'/'.join(map(str, options.candidates))})"
    if device.type == "cuda":
        if gpu >= GPU_SLOW_SECONDS:
            warnings.warn(f"{work} will take about {format_seconds(gpu)} at the H200's measured rate "
                          f"(other GPUs differ), calibration not included", SlowWorkWarning, stacklevel=3)
        return
    threads = torch.get_num_threads()
    seconds = sum(estimate_seconds(tiles, k, device, threads=threads) for k in options.candidates)
    if seconds >= SLOW_SECONDS:
        warnings.warn(f"{work} will take about {format_seconds(seconds)} on this CPU, calibration not "
                      f"included; an H200 takes ~{format_seconds(gpu)}: run on a machine with a CUDA GPU "
                      f"(--device cuda)", SlowWorkWarning, stacklevel=3)


def _finish_bits(run: _Run) -> dict[str, int]:
    if run.options.bpw is not None:
        return allocate_bits(run.stats, run.options.bpw)
    return {s.name: int(run.options.bits) for s in run.stats}  # type: ignore[arg-type]


def _report(run: _Run, bits_map: dict[str, int], calib_info: dict, t0: float) -> QuantizeReport:
    o = run.options
    mode = f"bpw={o.bpw}" if o.bpw is not None else f"bits={o.bits}"
    hessian = "used (LDLQ)" if o.use_hessian else "off (--no-hessian): Hessians only measure the proxy error"
    if o.encoder:
        mode += f", encoder={o.encoder}"
    return QuantizeReport(mode, bits_map, run.stats, len(run.stack), run.layer_seconds, run.resumed,
                          hessian, calib_info, run.skipped, time.perf_counter() - t0)


# -- in memory ------------------------------------------------------------------------------
def quantize_module(model: nn.Module, options: QuantizeOptions | None = None, tokenizer=None,
                    texts: list[str] | None = None) -> QuantizeReport:
    """Quantize a loaded transformers model in place (its nn.Linears become EschaLinears).

    The same algorithm as ``quantize_model`` without the checkpoint streaming and resume; with
    equal options and inputs the two produce identical weights. Scale tuning is not part of it
    (``tune_steps`` None or 0): it needs the reference next to the quantized model, which
    ``quantize_model`` reads from the checkpoint (or call ``escha.model.tune.tune_scales``).
    """
    options = options_or_default(options)
    if options.tune_steps:
        raise ModelError("quantize_module does not tune scales: quantize_model (escha quantize) does, "
                         "or call escha.model.tune.tune_scales with the reference model")
    t0 = time.perf_counter()
    device = quantization_device(model, options)
    stack_name, stack = find_layer_stack(model, getattr(model.config, "num_hidden_layers", None))
    _warn_unmatched_skip(model, options)
    targets = quantization_targets(model, options)
    _notice_if_slow(targets, options, device)
    texts = texts if texts is not None else read_calibration(options.calib)
    samples = tokenize(texts, tokenizer, model.config.vocab_size, is_causal(model),
                       calibration_seq_len(model.config, options.seq_len), options.max_samples)
    source = InMemory()
    with bar(_tiles(targets, options), "quantize", options.progress, unit="tile") as progress, torch.no_grad():
        run = _Run(model, stack_name, stack, options, device, progress)
        calib = capture_inputs(model, stack[0], samples.samples, device)
        _quantize_stack(run, calib, samples.samples, source)
    bits_map = _finish_bits(run)
    # The final modules: EschaLinears at the chosen K, keeping the original biases, those
    # quantized over one input grouped to run as one product and the RMSNorms before them
    # folded into them, as escha.load_model does.
    run.install(source.linears, source.candidates, bits_map, dense=False)
    fuse_projections(model)
    return _report(run, bits_map, {"source": samples.source, "samples": len(samples.samples),
                                   "tokens": samples.tokens}, t0)


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


def _check_out_path(model_dir: str, out_dir: str) -> None:
    """What can be said of OUT_DIR before any work: it is not MODEL_DIR, nor a file."""
    if os.path.abspath(model_dir) == os.path.abspath(out_dir):
        raise ModelError("OUT_DIR must differ from MODEL_DIR")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ModelError(f"OUT_DIR {out_dir} exists and is not a directory; choose a directory path")


def _check_out_dir(out_dir: str, overwrite: bool) -> None:
    """OUT_DIR's contents, once ``_check_out_path`` has passed: a model there needs ``overwrite``."""
    from .output import clear_output, is_output_file
    if os.path.isdir(out_dir):
        present = [f for f in os.listdir(out_dir) if f != PARTIAL_DIR]
        if (present and os.path.isdir(os.path.join(out_dir, PARTIAL_DIR)) and "config.json" not in present
                and all(is_output_file(f) for f in present)):
            # A run stopped while assembling the output (config.json comes last): its files are
            # rewritten from the partial results.
            clear_output(out_dir)
            present = []
        if present and not overwrite:
            raise ModelError(f"{out_dir} is not empty ({', '.join(sorted(present)[:4])}...); "
                             "choose a new directory or pass --overwrite")
        if present:
            clear_output(out_dir)
    os.makedirs(out_dir, exist_ok=True)


def _tune_plan(options: QuantizeOptions, causal: bool, config, layers: int, params: int, seq_len: int,
               device: torch.device) -> TunePlan:
    """How this run tunes (``tune.plan``: ``options.tune_steps``, or by default 256 steps on a GPU
    where they fit; none for models that are not causal LMs), with a note when the default
    skips it for memory."""
    steps = options.tune_steps if causal or options.tune_steps else 0
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    p = plan(steps, device, free, params, options.torch_dtype, seq_len, config.vocab_size, layers,
             getattr(config, "hidden_size", 0), getattr(config, "num_attention_heads", 0))
    if steps is None and not p.steps and free is not None:
        warnings.warn(f"scale tuning skipped: it needs about {p.need_bytes / 2**30:.0f} GiB of GPU memory and "
                      f"{free / 2**30:.0f} GiB are free (--tune-steps {DEFAULT_STEPS} runs it anyway)", stacklevel=3)
    return p


def quantize_model(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                   options: QuantizeOptions | None = None, restart: bool = False,
                   overwrite: bool = False) -> QuantizeReport:
    """Quantize a local HF safetensors checkpoint into an Escha W2 model directory.

    Streams one layer at a time (parameters of the others stay on the meta device), saves each
    finished layer to OUT_DIR/.partial/ and skips those on a rerun, then writes an HF-style
    directory: config.json with ``quantization_config``, safetensors shards, tokenizer files and
    escha_report.json.

    Args:
        model_dir: the checkpoint (config.json and safetensors).
        out_dir: the directory to write; it must not be ``model_dir`` nor a file.
        options: a QuantizeOptions (None: its defaults, K=2 everywhere but lm_head); a dict of
            settings raises TypeError: pass ``QuantizeOptions(**settings)``.
        restart: discard earlier partial results instead of resuming from them.
        overwrite: replace the files of a model already in ``out_dir``; without it a non-empty
            ``out_dir`` (other than partial results) raises ModelError.

    Returns:
        The QuantizeReport of the run (also written to ``out_dir``/escha_report.json).
    """
    from .. import __version__
    from .output import write_output, write_report

    options = options_or_default(options)
    t0 = time.perf_counter()
    model_dir, out_dir = os.fspath(model_dir), os.fspath(out_dir)
    reader = CheckpointReader(model_dir)
    config = _load_config(model_dir)
    _check_out_path(model_dir, out_dir)
    # Before the checkpoint's weights load: a bad calibration file fails in a moment.
    texts = read_calibration(options.calib)
    device, dtype = resolve_device(options.device), options.torch_dtype
    model = build_skeleton(config, dtype)
    stack_name, stack = find_layer_stack(model, getattr(config, "num_hidden_layers", None))
    _warn_unmatched_skip(model, options)
    names = list(model.state_dict().keys())
    buffers = {n for n, _ in model.named_buffers()}
    in_stack = lambda n: n.startswith(stack_name + ".")  # noqa: E731
    tied = {n + ".weight" for n, _ in model.named_modules() if n and is_tied_output(model, n)}

    shell = [n for n in names if not in_stack(n)]
    shell_keys = load_tensors(model, shell, reader, device, dtype, optional=buffers | tied)
    tie_output_embeddings(model)
    checkpoint_params = sum(p.numel() for p in model.parameters())  # a tied head counts once
    missing = [n for n in meta_tensors(model) if not in_stack(n)]
    if missing:
        raise ModelError(f"{model_dir}: checkpoint lacks {missing[:4]}")
    _to_device(model, "", model, device)  # buffers outside the stack; layer buffers move on load

    causal = is_causal(model)
    if options.tune_steps and not causal:
        raise ModelError(f"scale tuning (--tune-steps) needs a causal language model; {type(model).__name__} is not one")
    samples = tokenize(texts, _load_tokenizer(model_dir), config.vocab_size, causal,
                       calibration_seq_len(config, options.seq_len), options.max_samples)
    if restart:
        discard_partial(out_dir)
    _check_out_dir(out_dir, overwrite)
    store = PartialStore(out_dir, options.identity({
        "model": os.path.abspath(model_dir), "calib": text_digest(texts), "escha": __version__,
        "calib_source": samples.source}))

    targets = quantization_targets(model, options)
    # The notice counts the work left: layers (and a tail) an earlier run finished are resumed.
    finished = tuple(f"{stack_name}.{i}." for i in range(len(stack)) if store.has(layer_key(i)))
    left = [(n, m) for n, m in targets
            if not (finished and n.startswith(finished)) and (in_stack(n) or not store.has(TAIL))]
    _notice_if_slow(left, options, device)
    with bar(_tiles(targets, options), "quantize", options.progress, unit="tile") as progress, torch.no_grad():
        run = _Run(model, stack_name, stack, options, device, progress)
        calib = capture_inputs(model, stack[0], samples.samples, device)
        tail = _quantize_stack(run, calib, samples.samples, Streamed(model, reader, store, device, dtype))
    bits_map = _finish_bits(run)
    report = _report(run, bits_map, {"source": samples.source, "samples": len(samples.samples),
                                     "tokens": samples.tokens, "file": options.calib}, t0)
    report.input_bytes, report.checkpoint_params = reader.size_bytes(), checkpoint_params
    quantized = {f"{s.name}.weight" for s in run.stats}
    shell_raw = {n: k for n, k in shell_keys.items() if n not in quantized and n not in tied}
    write_output(out_dir, model_dir, reader, store, shell_raw, len(stack), TAIL if tail else None,
                 bits_map, report, options)
    layers = len(stack)
    del model, stack, calib, run  # the calibration's hidden states: free before tuning
    tune_plan = _tune_plan(options, causal, config, layers, checkpoint_params,
                           max(x.shape[-1] for x in samples.samples), device)
    if tune_plan.steps:
        try:
            report.tune = result_json(tune_directory(model_dir, out_dir, samples.samples,
                                                     replace(options.tune, steps=tune_plan.steps), device, tune_plan,
                                                     options.progress))
        except Exception as e:  # the model is written: say so, and keep it
            what = (f"scale tuning failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                    f"{out_dir} holds the quantized model, untuned")
            if options.tune_steps is not None:  # asked for: an error
                raise ModelError(what) from e
            warnings.warn(what + " (--tune-steps 0 skips tuning)", stacklevel=2)
            report.tune = {"error": what}
        write_report(out_dir, report)
    report.total_seconds = time.perf_counter() - t0
    return report
