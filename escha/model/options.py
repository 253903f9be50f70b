"""Options of a quantization run and the statistics it records."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from ..devices import resolve_device
from ..quant.quantize import check_encoder
from .errors import ModelError
from .tune import TuneOptions

ALLOWED_BITS = (2, 3)
# Left unquantized unless asked: the output head (its error reaches the logits undamped, and a
# tied head shares the embeddings, which stay full size anyway).
DEFAULT_SKIP = ("lm_head",)


@dataclass
class QuantizeOptions:
    """What ``escha quantize`` does.

    Exactly one of ``bits`` (every Linear at K=bits) and ``bpw`` (K in {2, 3} per Linear,
    allocated by measured sensitivity to meet this average) applies; ``bpw`` wins if set.
    """

    bits: int | None = 2
    bpw: float | None = None
    calib: str | None = None  # UTF-8 text file; None = the shipped corpus (escha/model/data)
    # Module names or globs; the whole list (lm_head included). A single string is one pattern; a
    # pattern with a comma is refused (no module name has one).
    skip: tuple[str, ...] | str = DEFAULT_SKIP
    seed: int = 0
    # None: quantize_model uses CUDA when torch sees a GPU, else the CPU; quantize_module and
    # fake_quantize_module the device the model is on.
    device: str | None = None
    # 128 x 2048 = 262,144 calibration tokens: many times the widest Linear input of common
    # models (1536 in SmolLM2-135M, 17408 in Qwen3-14B), so that every H = E[x x^T] has full rank
    # and a stable spectrum; 2048 tokens reach the positions that long prompts use. Shortened to
    # the model's maximum positions. docs/MODELS.md explains the choice.
    seq_len: int = 2048
    max_samples: int = 128
    encoder: str | None = None  # escha.quantize's encoder ("viterbi", "greedy"); None = its default
    use_hessian: bool = True  # pass calibration Hessians to the encoder (LDLQ)
    dtype: str = "float32"  # compute dtype of the calibration forward passes
    progress: bool | None = None  # a bar on stderr: None = when stderr is a terminal
    # Scale tuning after quantization (escha.model.tune): optimizer steps over the calibration
    # samples (0: none; None: tune.DEFAULT_STEPS on a GPU where it fits, else none) and Adam's
    # learning rate on log(row scale). Causal LMs only.
    tune_steps: int | None = None
    tune_lr: float = 1e-3

    def __post_init__(self) -> None:
        # A string is iterable: without this, "lm_head" would become seven one-letter patterns.
        skip = (self.skip,) if isinstance(self.skip, str) else self.skip
        if not isinstance(skip, (tuple, list)) or not all(isinstance(s, str) for s in skip):
            raise TypeError(f"skip must be a module name or a tuple of names/globs, got {self.skip!r}")
        if any("," in s for s in skip):  # module names hold no commas: "lm_head,embed" would match nothing, silently
            raise ValueError(f"skip patterns name modules, which hold no commas: pass a tuple, e.g. "
                             f"{tuple(p for s in skip for p in s.split(',') if p)!r}, not {self.skip!r}")
        self.skip = tuple(s for s in skip if s)
        _check_number("bpw", self.bpw, float, optional=True)
        _check_number("seq_len", self.seq_len, int)
        _check_number("max_samples", self.max_samples, int)
        if self.bpw is not None:
            if not (ALLOWED_BITS[0] <= self.bpw <= ALLOWED_BITS[-1]):
                raise ModelError(f"--bpw must lie in [{ALLOWED_BITS[0]}, {ALLOWED_BITS[-1]}], got {self.bpw}")
            self.bits = None
        elif self.bits not in ALLOWED_BITS:
            raise ModelError(f"--bits must be one of {ALLOWED_BITS}, got {self.bits!r}")
        if self.seq_len < 2 or self.max_samples < 1:
            raise ModelError("seq_len must be >= 2 and max_samples >= 1")
        if self.encoder is not None:
            try:
                self.encoder = check_encoder(self.encoder).value
            except ValueError as e:
                raise ModelError(str(e)) from None
        if self.device is not None:
            self.device = str(resolve_device(self.device))
        self.torch_dtype  # validates the name
        self.tune  # validates the tuning settings

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype ``dtype`` names; raises ModelError unless it is a floating dtype."""
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise ModelError(f"dtype must name a torch floating dtype, got {self.dtype!r}")
        return dt

    @property
    def tune(self) -> TuneOptions:
        """The scale-tuning settings (``escha.model.tune``)."""
        return TuneOptions(steps=self.tune_steps or 0, lr=self.tune_lr)

    @property
    def candidates(self) -> tuple[int, ...]:
        """The K values each Linear is quantized at (both when allocating by bpw)."""
        return ALLOWED_BITS if self.bpw is not None else (int(self.bits),)  # type: ignore[arg-type]

    @property
    def propagate_bits(self) -> int:
        """K of the weights that produce the next layer's calibration inputs."""
        return self.candidates[0]

    def identity(self, extra: dict) -> dict:
        """Everything that changes a layer's result; partial results are reused only on a match."""
        keep = {k: v for k, v in asdict(self).items()
                if k not in ("bpw", "bits", "device", "progress", "calib", "tune_steps", "tune_lr")}
        return {**keep, "skip": list(self.skip), "candidates": list(self.candidates), **extra}


def options_or_default(options: QuantizeOptions | None) -> QuantizeOptions:
    """``options``, or the defaults for None; anything else (a dict of settings) raises TypeError."""
    if options is None:
        return QuantizeOptions()
    if not isinstance(options, QuantizeOptions):
        raise TypeError(f"options must be a QuantizeOptions (e.g. QuantizeOptions(bits=2)), "
                        f"got {type(options).__name__}")
    return options


def _check_number(name: str, value: object, kind: type, optional: bool = False) -> None:
    """Raise TypeError naming option ``name`` unless ``value`` is an int (or, for float, any real
    number), or None where ``optional``; bools are refused (True would pass as 1)."""
    if value is None and optional:
        return
    ok = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise TypeError(f"{name} must be {'a number' if kind is float else 'an int'}"
                        f"{' or None' if optional else ''}, got {value!r} ({type(value).__name__})")


@dataclass
class LinearStats:
    """Measured results for one Linear, per candidate K."""

    name: str
    layer: int  # index in the layer stack; the stack length for modules outside it
    shape: tuple[int, int]
    proxy: dict[int, float] = field(default_factory=dict)  # E||(W - W_hat) x||^2 per token
    proxy_rel: dict[int, float] = field(default_factory=dict)  # proxy / E||W x||^2
    weight_rel: dict[int, float] = field(default_factory=dict)  # ||W - W_hat||^2 / ||W||^2
    storage_bpw: dict[int, float] = field(default_factory=dict)
    seconds: float = 0.0
    hessian: str = "used"  # "used" (LDLQ), or "off" when --no-hessian kept it out of the encoder
    # The first Linear of the set that reads this one's input and was quantized with it
    # (escha.quant.quantize_shared; they share K); its own name when it reads its input alone.
    shared_input: str = ""

    @property
    def params(self) -> int:
        """Weights in the Linear: rows x columns."""
        return self.shape[0] * self.shape[1]

    def to_json(self) -> dict:
        """A JSON-serializable dict: per-K maps keyed by str(K), shape as a list (``from_json`` inverts it)."""
        d = asdict(self)
        for k in ("proxy", "proxy_rel", "weight_rel", "storage_bpw"):
            d[k] = {str(b): v for b, v in d[k].items()}
        d["shape"] = list(self.shape)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "LinearStats":
        """The stats ``to_json`` wrote (JSON object keys back to int bit widths, the shape to a tuple)."""
        d = dict(d)
        for k in ("proxy", "proxy_rel", "weight_rel", "storage_bpw"):
            d[k] = {int(b): float(v) for b, v in d[k].items()}
        d["shape"] = tuple(d["shape"])
        return cls(**d)


def dumps(obj) -> str:
    """Stable JSON for identities and metadata."""
    return json.dumps(obj, sort_keys=True)
