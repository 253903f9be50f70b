"""The layer-by-layer machinery: capture layer inputs, collect Hessians, quantize, propagate."""
from __future__ import annotations

import fnmatch
import inspect
import time
import zlib
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from .. import quant
from ..format.codec import dequantize
from ..format.qweight import QuantizedWeight
from .errors import ModelError, UnsupportedModelError
from .options import LinearStats, QuantizeOptions


class _Stop(Exception):
    """Raised by the capture hook to end a forward pass at the first layer."""


@dataclass
class LayerCall:
    """One calibration sample at the input of a layer: its hidden states and the other arguments."""

    hidden: torch.Tensor
    args: tuple
    kwargs: dict


@dataclass
class Calibration:
    """Per-sample layer inputs, advanced through the stack one layer at a time."""

    calls: list[LayerCall]
    tuple_output: bool | None = None  # whether layers return (hidden, ...) rather than a tensor

    def run(self, layer: nn.Module) -> list[torch.Tensor]:
        """Outputs of ``layer`` for every sample."""
        outs = []
        for c in self.calls:
            out = layer(c.hidden, *c.args, **c.kwargs)
            self.tuple_output = isinstance(out, (tuple, list))
            outs.append(out[0] if self.tuple_output else out)
        return outs

    def advance(self, layer: nn.Module) -> None:
        """Replace every sample's hidden states by ``layer``'s output."""
        for c, h in zip(self.calls, self.run(layer)):
            c.hidden = h


def forward_kwargs(model: nn.Module) -> dict:
    """Keyword arguments that turn off caches for a calibration forward, where the model takes them."""
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def capture_inputs(model: nn.Module, first_layer: nn.Module, samples: list[torch.Tensor],
                   device: torch.device) -> Calibration:
    """Run the model up to its first layer on each sample and record that layer's arguments."""
    calls: list[LayerCall] = []

    def hook(module, args, kwargs):
        kwargs = dict(kwargs)
        if args:
            hidden, rest = args[0], tuple(args[1:])
        elif "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), ()
        else:
            raise UnsupportedModelError(f"{type(module).__name__} is called without hidden states")
        calls.append(LayerCall(hidden.detach(), rest, kwargs))
        raise _Stop

    handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
    extra = forward_kwargs(model)
    try:
        for ids in samples:
            try:
                model(input_ids=ids.to(device), **extra)
            except _Stop:
                continue
            raise UnsupportedModelError(f"{type(model).__name__}.forward never reached its layer stack")
    finally:
        handle.remove()
    return Calibration(calls)


def skip_matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a module name is excluded: a pattern equals a run of its dotted parts, or globs it."""
    parts = name.split(".")
    for p in patterns:
        pp = p.split(".")
        if any(parts[i:i + len(pp)] == pp for i in range(len(parts) - len(pp) + 1)):
            return True
        if fnmatch.fnmatchcase(name, p):
            return True
    return False


def target_linears(root: nn.Module, prefix: str, skip: tuple[str, ...]) -> list[tuple[str, nn.Linear]]:
    """(full name, module) of every nn.Linear below ``root`` that is not skipped."""
    out = []
    for name, mod in root.named_modules():
        full = f"{prefix}.{name}" if prefix and name else (prefix or name)
        if isinstance(mod, nn.Linear) and not skip_matches(full, skip):
            if mod.weight.dim() != 2:
                raise ModelError(f"{full}: weight must be 2-D, got shape {list(mod.weight.shape)}")
            out.append((full, mod))
    return out


class HessianCollector:
    """Accumulates H = E[x x^T] over the inputs of the given Linears (forward pre-hooks), and
    finds the Linears that read one input: those called one after another with the same tensor
    (q, k, v; gate, up), which ``shared_inputs`` lists."""

    def __init__(self, linears: list[tuple[str, nn.Linear]]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}
        self._runs: list[list[str]] = []  # Linears in first-call order, grouped by input tensor
        self._last_input: torch.Tensor | None = None  # held, so no later tensor can take its place
        self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in linears]

    def _hook(self, name: str):
        def fn(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            if name not in self.sums:  # first call: which input does it read?
                if self._runs and args[0] is self._last_input:
                    self._runs[-1].append(name)
                else:
                    self._runs.append([name])
                self._last_input = args[0]
                self.sums[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
                self.count[name] = 0
            self.sums[name].addmm_(x.T, x)
            self.count[name] += x.shape[0]
        return fn

    def shared_inputs(self) -> list[list[str]]:
        """The Linears in the order of their first call, each list one input tensor's readers."""
        return [list(r) for r in self._runs]

    def remove(self) -> None:
        """Detach the hooks and drop the held input; the sums collected so far stay readable."""
        for h in self._handles:
            h.remove()
        self._last_input = None

    def hessian(self, name: str) -> torch.Tensor:
        """H = E[x x^T] over the rows ``name`` has seen; raises ModelError if it saw none."""
        if name not in self.sums:
            raise ModelError(f"{name} saw no inputs during calibration (is it used by the forward pass?)")
        return self.sums[name] / self.count[name]


def linear_seed(seed: int, name: str) -> int:
    """A per-Linear seed: the random signs differ between Linears yet stay reproducible."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**31 - 1)


def measure(w: torch.Tensor, qw: QuantizedWeight, hessian: torch.Tensor) -> tuple[float, float, float]:
    """(proxy loss E||E x||^2, proxy relative to E||W x||^2, relative weight error) with E = W - W_hat."""
    w = w.float()
    e = w - dequantize(qw).to(w.device)
    proxy = float(((e @ hessian) * e).sum())
    base = float(((w @ hessian) * w).sum())
    return proxy, proxy / base if base > 0 else 0.0, float(e.pow(2).sum() / w.pow(2).sum().clamp_min(1e-30))


def input_groups(linears: list[tuple[str, nn.Linear]], hessians: HessianCollector) -> list[list[str]]:
    """The names of ``linears`` grouped by the input they read, in the order of their first call
    (``hessians.shared_inputs()``), then each Linear the calibration never called, alone."""
    names = {n for n, _ in linears}
    groups = [[n for n in run if n in names] for run in hessians.shared_inputs()]
    seen = {n for g in groups for n in g}
    return [g for g in groups if g] + [[n] for n, _ in linears if n not in seen]


def in_order(stats: list[LinearStats], linears: list[tuple[str, nn.Linear]]) -> list[LinearStats]:
    """``stats`` sorted in the order of ``linears``."""
    order = {n: i for i, (n, _) in enumerate(linears)}
    return sorted(stats, key=lambda st: order[st.name])


def quantize_linears(linears: list[tuple[str, nn.Linear]], hessians: HessianCollector, layer: int,
                     options: QuantizeOptions, progress: tqdm | None = None
                     ) -> tuple[dict[str, dict[int, QuantizedWeight]], list[LinearStats]]:
    """Quantize each Linear at every candidate K; returns the weights and their statistics.

    Linears that read one input (``hessians.shared_inputs()``) are quantized together
    (``escha.quant.quantize_shared``, seeded by the first one's name), so that they run as one
    product. The calibration Hessian goes to the quantizer (LDLQ) unless ``options.use_hessian``
    is off; it always measures the proxy loss. ``progress`` advances by every tile encoded.
    """
    qws: dict[str, dict[int, QuantizedWeight]] = {}
    stats: list[LinearStats] = []
    encoder = {} if options.encoder is None else {"encoder": options.encoder}
    modules = dict(linears)
    for names in input_groups(linears, hessians):
        t0 = time.perf_counter()
        ws = [modules[n].weight.detach() for n in names]
        for n, w in zip(names, ws):
            try:
                quant.check_weight(w, f"{n}.weight")
            except ValueError as e:
                raise ModelError(str(e)) from None
        hs = [hessians.hessian(n) for n in names]  # each member's, once for every candidate K
        h = hs[0]
        group = [LinearStats(n, layer, tuple(w.shape), hessian="used" if options.use_hessian else "off",
                             shared_input=names[0]) for n, w in zip(names, ws)]
        for n in names:
            qws[n] = {}
        if progress is not None:
            progress.set_postfix_str(",".join(names), refresh=False)
        seed = linear_seed(options.seed, names[0])
        for k in options.candidates:
            kwargs = dict(bits=k, hessian=h if options.use_hessian else None, seed=seed,
                          progress=_advance(progress), **encoder)
            parts = quant.quantize_shared(ws, **kwargs) if len(ws) > 1 else [quant.quantize(ws[0], **kwargs)]
            for n, w, qw, st, hn in zip(names, ws, parts, group, hs):
                st.proxy[k], st.proxy_rel[k], st.weight_rel[k] = measure(w, qw, hn)
                st.storage_bpw[k] = qw.bits_per_weight
                qws[n][k] = qw
        seconds = time.perf_counter() - t0
        for st in group:
            st.seconds = seconds * st.params / sum(g.params for g in group)
        stats.extend(group)
    return qws, in_order(stats, linears)


def _advance(progress: tqdm | None):
    """escha.quantize's progress callback that moves ``progress`` by the tiles newly encoded;
    False (nothing drawn, no notice) without a bar."""
    if progress is None:
        return False
    last = [0]

    def report(done: int, total: int) -> None:
        progress.update(done - last[0])
        last[0] = done
    return report


class Replay(nn.Module):
    """Stands in for every layer of a stack and returns stored final hidden states.

    Running the model with it in place evaluates only what follows the stack (final norm, head,
    pooler), so those modules see the inputs produced by the quantized layers.
    """

    def __init__(self, tuple_output: bool) -> None:
        super().__init__()
        self.tuple_output = tuple_output
        self.value: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        return (self.value,) if self.tuple_output else self.value


def run_tail(model: nn.Module, stack: nn.ModuleList, calib: Calibration, samples: list[torch.Tensor],
             device: torch.device, collector_linears: list[tuple[str, nn.Linear]]) -> HessianCollector:
    """Hessians of the Linears after the stack, from the final hidden states in ``calib``."""
    originals = list(stack)
    replay = Replay(bool(calib.tuple_output))
    for i in range(len(stack)):
        stack[i] = replay
    collector = HessianCollector(collector_linears)
    extra = forward_kwargs(model)
    try:
        for ids, call in zip(samples, calib.calls):
            replay.value = call.hidden
            model(input_ids=ids.to(device), **extra)
    finally:
        collector.remove()
        for i, layer in enumerate(originals):
            stack[i] = layer
    return collector
