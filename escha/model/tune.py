"""Scale tuning: after quantization, fit each quantized Linear's row scales and the model's norm
weights to the reference model's next-token distributions (``escha quantize --tune-steps N``).

The layer-by-layer quantizer fits every Linear to its own inputs; errors still add up through the
stack. The format leaves one real-valued parameter per output row, the scale ``c`` (docs/FORMAT.md
section 5: ``W = diag(g c su) Hn T Hk diag(sv)``), and the model keeps its norm weights in full
precision. Both can absorb some of the accumulated error at no cost in bits. Here they are trained
end to end: the quantized model runs with each Linear as ``y = (x @ W1^T) * c`` (``W1`` its weight
at c = 1, dense and frozen), against the reference model's logits on the calibration samples,
minimizing the token-mean KL divergence KL(reference || quantized). Row scales are trained as
``c = c0 exp(theta)`` (Adam, one learning rate for every layer's relative change); norm weights
directly, each with the learning rate times its mean magnitude. The codes, signs and global scale
do not change.

Some samples (one in eight, at least one) are held out: their KL is measured before tuning and
every quarter of the steps, and the parameters with the lowest held-out KL are kept, so tuning
never leaves the model worse on held-out text than quantization left it (it may leave it as it
was).

Memory: the reference model and a dense copy of the quantized one (its compute dtype) are on the
device at once, with one sample's activations and gradients.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..format.codec import dequantize
from ..format.qweight import QuantizedWeight
from ..nn.linear import EschaLinear, replace_linear
from ..progress import bar
from .errors import ModelError


#: ``escha quantize``'s default tuning steps where it tunes by default (``plan``): on
#: SmolLM2-135M, 256 steps took K=3 from perplexity 22.33 to 19.61 and K=2 from 44.10 to 29.92;
#: 768 (K=3) and 512 (K=2) steps gained 0.2% and 1.3% more (benchmarks/results/tune_h200/).
DEFAULT_STEPS = 256


MEMORY_MARGIN = 0.8  # the share of the free device memory a plan may count on (allocator, context, temporaries)


def memory_bytes(params: int, dtype: torch.dtype, seq_len: int, vocab: int, layers: int, hidden: int,
                 heads: int, checkpointing: bool = False) -> int:
    """A generous estimate of the device memory tuning takes: the reference and a dense copy of the
    model in ``dtype``, a sample's logits (float32, a few copies for the KL and its gradient) and
    the layers' saved activations (32 per hidden unit, and eager attention's probabilities; with
    ``checkpointing``, each layer's input and one layer's activations)."""
    size = torch.empty((), dtype=dtype).element_size()
    logits = 8 * seq_len * vocab * 4
    layer = seq_len * (32 * hidden + 2 * heads * seq_len) * size
    acts = layers * seq_len * hidden * size + layer if checkpointing else layers * layer
    return 2 * params * size + logits + acts


@dataclass(frozen=True)
class TunePlan:
    """How a run tunes: its steps, the dtype of the reference and of the dense copy, whether the
    student recomputes each layer's activations in the backward pass (transformers' gradient
    checkpointing), and the memory that takes (``memory_bytes``)."""

    steps: int
    dtype: torch.dtype
    checkpointing: bool
    need_bytes: int


def plan(steps: int | None, device: torch.device, free_bytes: int | None, params: int, dtype: torch.dtype,
         seq_len: int, vocab: int, layers: int, hidden: int, heads: int) -> TunePlan:
    """The leanest-first choice that fits MEMORY_MARGIN of ``free_bytes``: ``dtype`` (the
    calibration's), then ``dtype`` with gradient checkpointing, then bfloat16 with it. ``steps``
    None is ``--tune-steps``' default: DEFAULT_STEPS on a CUDA device where one choice fits, else
    0 (on a CPU each step is a forward and backward pass of the whole model: hours on a real
    one). Given steps run with the first choice that fits, or the leanest."""
    choices = [(dtype, False), (dtype, True)] + ([(torch.bfloat16, True)] if dtype != torch.bfloat16 else [])
    if device.type != "cuda" or free_bytes is None:
        need = memory_bytes(params, dtype, seq_len, vocab, layers, hidden, heads)
        return TunePlan(steps or 0, dtype, False, need)
    for dt, ckpt in choices:
        need = memory_bytes(params, dt, seq_len, vocab, layers, hidden, heads, ckpt)
        if need <= MEMORY_MARGIN * free_bytes:
            return TunePlan(DEFAULT_STEPS if steps is None else steps, dt, ckpt, need)
    return TunePlan(0 if steps is None else steps, dt, ckpt, need)


@dataclass(frozen=True)
class TuneOptions:
    """What ``tune_scales`` does."""

    steps: int  # optimizer steps, one calibration sample each (cycling over the training samples)
    lr: float = 1e-3  # Adam's step on log(c) and, times each norm's mean |weight|, on the norm weights
    norms: bool = True  # also train the norm weights (RMSNorm, LayerNorm)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ModelError(f"tune steps must be >= 0, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ModelError(f"tune learning rate must be a positive number, got {self.lr}")


@dataclass
class TuneResult:
    """What a tuning run did; ``asdict`` goes into escha_report.json as ``tune``."""

    steps: int
    lr: float
    train_samples: int
    heldout_samples: int
    scales: int  # row scales trained
    norm_weights: int  # norm weight entries trained
    kl_before: float  # held-out token-mean KL(reference || quantized), nats
    kl_after: float  # the same with the kept parameters
    kept_step: int  # the step whose parameters were kept (0: those quantization gave)
    curve: list[tuple[int, float]]  # (step, held-out KL) at each check
    seconds: float
    dtype: str = "float32"  # the dense copy's and the reference's
    checkpointing: bool = False  # the student recomputed its layers' activations in the backward pass


class _ScaledDense(nn.Module):
    """y = (x @ W1^T) * (c0 exp(theta)) + b: a quantized Linear with trainable row scales."""

    def __init__(self, mod: EschaLinear, dtype: torch.dtype) -> None:
        super().__init__()
        qw = mod.qweight
        unit = QuantizedWeight.trusted([qw.trellis, qw.su, qw.sv, torch.ones_like(qw.scale), qw.gscale],
                                       qw.shape, qw.bits, qw.codebook_id)
        self.register_buffer("w1", dequantize(unit).to(dtype))  # W at c = 1: diag(g su) Hn T Hk diag(sv)
        self.register_buffer("c0", qw.scale[:qw.out_features].float())
        self.theta = nn.Parameter(torch.zeros_like(self.c0))
        self.bias = None if mod.bias is None else mod.bias.detach().to(dtype)
        self.source = mod

    def scale(self) -> torch.Tensor:
        return self.c0 * torch.exp(self.theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.w1) * self.scale().to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def norm_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every norm with a weight: transformers' RMSNorms and nn.LayerNorm."""
    return [(n, m) for n, m in model.named_modules()
            if (type(m).__name__.endswith("RMSNorm") or isinstance(m, nn.LayerNorm))
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Token-mean KL(teacher || student) of [1, L, V] logits, in float32."""
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    s = F.log_softmax(student_logits.float(), dim=-1)
    return (t.exp() * (t - s)).sum(-1).mean()


def _set_checkpointing(model: nn.Module, on: bool) -> None:
    """transformers' activation checkpointing on or off, under the name this release gives it
    (``activation_checkpointing_*``, formerly ``gradient_checkpointing_*``)."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def _train_without_dropout(model: nn.Module) -> None:
    """Training mode (transformers checkpoints layers only in it), with every dropout off."""
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.eval()


def tune_scales(student: nn.Module, teacher: nn.Module, samples: list[torch.Tensor], options: TuneOptions,
                device: torch.device, dtype: torch.dtype = torch.float32,
                progress: bool | None = None, checkpointing: bool = False) -> TuneResult:
    """Train ``student``'s EschaLinear row scales (and norm weights) against ``teacher``'s logits.

    ``student``: a model holding EschaLinears (as ``escha.model.loading.load_unfused`` gives it),
    on ``device``; its EschaLinears get the tuned scales (fp16, as stored) and its norms the tuned
    weights, in place. ``teacher``: the reference model, on ``device``. ``samples``: token ids
    [1, L] each (the calibration samples). ``dtype``: the dense copy's. ``checkpointing``: the
    student recomputes each layer's activations in the backward pass (transformers' gradient
    checkpointing, where the model supports it; the same gradients, less memory). Returns what
    happened; with ``options.steps == 0`` or no gain on the held-out samples the student is left
    as it was.
    """
    if not samples:
        raise ModelError("scale tuning needs at least one calibration sample")
    t0 = time.perf_counter()
    held = max(1, len(samples) // 8) if len(samples) > 1 else 0
    train = samples[:len(samples) - held] if held else samples
    heldout = samples[len(samples) - held:] if held else samples
    linears = [(n, m) for n, m in student.named_modules() if isinstance(m, EschaLinear)]
    if not linears:
        raise ModelError("scale tuning found no quantized Linear in the model")
    dense = {}
    for name, mod in linears:
        new = _ScaledDense(mod, dtype).to(device)
        replace_linear(student, name, new)
        dense[name] = new
    norms = norm_modules(student) if options.norms else []
    norm_start = {n: m.weight.detach().clone() for n, m in norms}
    for p in student.parameters():
        p.requires_grad_(False)
    for d in dense.values():
        d.theta.requires_grad_(True)
    groups = [{"params": [d.theta for d in dense.values()], "lr": options.lr}]
    for n, m in norms:
        m.weight.requires_grad_(True)
        groups.append({"params": [m.weight], "lr": options.lr * max(float(m.weight.detach().abs().mean()), 1e-3)})
    opt = torch.optim.Adam(groups)

    def snapshot() -> tuple[dict, dict]:
        return ({n: d.theta.detach().clone() for n, d in dense.items()},
                {n: m.weight.detach().clone() for n, m in norms})

    def restore(state: tuple[dict, dict]) -> None:
        with torch.no_grad():
            for n, t in state[0].items():
                dense[n].theta.copy_(t)
            for (n, m) in norms:
                m.weight.copy_(state[1][n])

    no_cache = {"use_cache": False}

    @torch.no_grad()
    def heldout_kl() -> float:
        was = student.training
        student.eval()  # no recomputation without gradients
        total = 0.0
        for ids in heldout:
            ids = ids.to(device)
            total += float(_kl(student(input_ids=ids, **no_cache).logits, teacher(input_ids=ids, **no_cache).logits))
        if was:
            _train_without_dropout(student)
        return total / len(heldout)

    student.eval()
    teacher.eval()
    checkpointing = checkpointing and bool(getattr(student, "supports_gradient_checkpointing", False))
    if checkpointing:  # transformers recomputes layers only in training mode; no dropout here
        _set_checkpointing(student, True)
        _train_without_dropout(student)
    try:
        with torch.enable_grad():
            best_kl = kl_before = heldout_kl()
            best, best_step = snapshot(), 0
            curve = [(0, kl_before)]
            check_every = max(1, options.steps // 4)
            with bar(options.steps, "tune", progress, unit="step") as pbar:
                for step in range(1, options.steps + 1):
                    ids = train[(step - 1) % len(train)].to(device)
                    with torch.no_grad():
                        target = teacher(input_ids=ids, **no_cache).logits
                    loss = _kl(student(input_ids=ids, **no_cache).logits, target)
                    if not torch.isfinite(loss):  # diverged: keep the best parameters seen
                        curve.append((step, float("nan")))
                        break
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    pbar.update(1)
                    if step % check_every == 0 or step == options.steps:
                        kl = heldout_kl()
                        curve.append((step, kl))
                        if kl < best_kl:
                            best_kl, best, best_step = kl, snapshot(), step
            restore(best)
    finally:
        if checkpointing:
            _set_checkpointing(student, False)
            student.eval()
        for n, m in norms:
            m.weight.requires_grad_(False)
        for name, d in dense.items():
            mod = d.source
            if best_step:
                qw = mod.qweight
                c = qw.scale.clone()
                c[:qw.out_features] = d.scale().detach().to(c.device).clamp(-65504, 65504).half()
                mod.set_qweight(QuantizedWeight(qw.trellis, qw.su, qw.sv, c, qw.gscale, shape=qw.shape,
                                                bits=qw.bits, codebook_id=qw.codebook_id))
            replace_linear(student, name, mod)
        if not best_step:
            with torch.no_grad():
                for n, m in norms:
                    m.weight.copy_(norm_start[n])
    return TuneResult(steps=options.steps, lr=options.lr, train_samples=len(train), heldout_samples=len(heldout),
                      scales=sum(d.c0.numel() for d in dense.values()),
                      norm_weights=sum(m.weight.numel() for _, m in norms), kl_before=kl_before, kl_after=best_kl,
                      kept_step=best_step, curve=curve, seconds=time.perf_counter() - t0,
                      dtype=str(dtype).replace("torch.", ""), checkpointing=checkpointing)


def result_json(result: TuneResult) -> dict:
    """The ``tune`` entry of escha_report.json."""
    d = asdict(result)
    d["curve"] = [list(p) for p in result.curve]
    return d


def tune_directory(model_dir: str, out_dir: str, samples: list[torch.Tensor], options: TuneOptions,
                   device: torch.device, tune_plan: TunePlan, progress: bool | None = None) -> TuneResult:
    """Tune the model ``escha quantize`` wrote to ``out_dir`` against the reference in
    ``model_dir`` (``tune_scales``, in the plan's dtype and checkpointing) and write the kept
    scales and norm weights back into its shards (``output.write_tuned``)."""
    from transformers import AutoModelForCausalLM

    from .loading import load_unfused
    from .output import write_tuned

    dtype = tune_plan.dtype
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True).to(device)
    student = load_unfused(out_dir, device, dtype)
    result = tune_scales(student, teacher, samples, options, device, dtype, progress, tune_plan.checkpointing)
    if result.kept_step:
        write_tuned(out_dir, student)
    return result
