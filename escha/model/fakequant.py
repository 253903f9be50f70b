"""Fake quantization of a model in memory by another quantizer, with escha's calibration.

Peers in the benchmarks (RTN, MXFP4, a GPTQ-style scalar LDLQ) replace each Linear's weight by
their reconstruction W_hat. Quantizers that use a Hessian get exactly what escha's pipeline gives
its own encoder: the same calibration samples, H = E[x x^T] from forward pre-hooks, and layer
inputs propagated through the layers already quantized.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from tqdm import tqdm

from ..progress import bar as progress_bar
from .calib import calibration_seq_len, read_calibration, tokenize
from .checkpoint import find_layer_stack
from .engine import HessianCollector, capture_inputs, run_tail, target_linears
from .options import QuantizeOptions, options_or_default
from .pipeline import is_causal, quantization_device, quantization_targets

# quantize(name, W float32 [out, in], H float32 [in, in] or None) -> W_hat [out, in]
WeightQuantizer = Callable[[str, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


@dataclass
class FakeQuantReport:
    """Per-Linear relative proxy error tr(E H E^T) / tr(W H W^T) (NaN without Hessians) and time."""

    proxy_rel: dict[str, float] = field(default_factory=dict)
    params: int = 0
    calibration: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def mean_proxy_rel(self) -> float:
        """Unweighted mean of ``proxy_rel`` over the Linears, NaNs left out; NaN when none remains."""
        vals = [v for v in self.proxy_rel.values() if v == v]
        return sum(vals) / len(vals) if vals else float("nan")


def _replace(mod: nn.Linear, w_hat: torch.Tensor) -> None:
    with torch.no_grad():
        mod.weight.copy_(w_hat.to(device=mod.weight.device, dtype=mod.weight.dtype))


def _rel(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    e = w - w_hat
    den = float(((w @ h) * w).sum())
    return float(((e @ h) * e).sum()) / den if den > 0 else 0.0


@torch.no_grad()
def fake_quantize_module(model: nn.Module, quantize: WeightQuantizer, options: QuantizeOptions | None = None,
                         tokenizer=None, texts: list[str] | None = None, use_hessian: bool = True) -> FakeQuantReport:
    """Replace, in place, the weight of every Linear escha would quantize by ``quantize(name, W, H)``.

    With ``use_hessian`` the layers are processed in order on calibration inputs (``options``:
    calibration text, seq_len, max_samples, device, skip) and ``H`` is that Linear's Hessian;
    without it, every weight is passed with ``H = None`` and no calibration runs. Tied output
    embeddings are left alone, as escha leaves them.
    """
    options = options_or_default(options)
    t0 = time.perf_counter()
    report = FakeQuantReport()
    stack_name, stack = find_layer_stack(model, getattr(model.config, "num_hidden_layers", None))
    all_targets = quantization_targets(model, options)
    report.params = sum(m.weight.numel() for _, m in all_targets)
    with progress_bar(len(all_targets), "fake-quantize", options.progress, unit="linear") as bar:
        _fake_quantize(model, quantize, options, tokenizer, texts, use_hessian, report, stack_name, stack,
                       all_targets, bar)
    report.seconds = time.perf_counter() - t0
    return report


def _fake_quantize(model: nn.Module, quantize: WeightQuantizer, options: QuantizeOptions, tokenizer,
                   texts: list[str] | None, use_hessian: bool, report: FakeQuantReport, stack_name: str,
                   stack: nn.ModuleList, all_targets: list[tuple[str, nn.Module]], bar: tqdm) -> None:
    """fake_quantize_module's work, advancing ``bar`` by one per Linear."""
    if not use_hessian:
        for name, mod in all_targets:
            bar.set_postfix_str(name, refresh=False)
            _replace(mod, quantize(name, mod.weight.detach().float(), None))
            report.proxy_rel[name] = float("nan")
            bar.update(1)
        return

    device = quantization_device(model, options)
    texts = texts if texts is not None else read_calibration(options.calib)
    samples = tokenize(texts, tokenizer, model.config.vocab_size, is_causal(model),
                       calibration_seq_len(model.config, options.seq_len), options.max_samples)
    report.calibration = {"source": samples.source, "samples": len(samples.samples), "tokens": samples.tokens}

    def quantize_group(linears, collector):
        for name, mod in linears:
            h = collector.hessian(name)
            w = mod.weight.detach().float()
            w_hat = quantize(name, w, h).float().to(w.device)
            report.proxy_rel[name] = _rel(w, w_hat, h)
            _replace(mod, w_hat)
            bar.set_postfix_str(name, refresh=False)
            bar.update(1)

    calib = capture_inputs(model, stack[0], samples.samples, device)
    for i, layer in enumerate(stack):
        linears = target_linears(layer, f"{stack_name}.{i}", options.skip)
        collector = HessianCollector(linears)
        try:
            calib.run(layer)
        finally:
            collector.remove()
        quantize_group(linears, collector)
        calib.advance(layer)  # the next layer sees this layer's quantized outputs
    tail = [(n, m) for n, m in all_targets if not n.startswith(stack_name + ".")]
    if tail:
        quantize_group(tail, run_tail(model, stack, calib, samples.samples, device, tail))
