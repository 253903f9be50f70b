"""Perplexity of a causal language model on a text: the code behind ``escha eval``.

Convention (the same for every model, so numbers compare):

* The text is tokenized as one stream with the model's tokenizer, adding no special tokens
  (no BOS/EOS). A checkpoint without tokenizer files falls back to UTF-8 bytes modulo the
  vocabulary, as calibration does; the result says so (``tokens_from``).
* The stream is cut into ``n = floor(T / L)`` non-overlapping windows of ``L = seq_len`` tokens,
  from the first token; the partial last window is dropped. With ``max_windows = K < n``, the K
  windows with indices ``floor(i * n / K)``, i = 0..K-1, are used: evenly spaced over the text.
* Each window is evaluated on its own, from an empty context: the model predicts tokens 2..L of
  the window from those before them (L - 1 predictions per window; the first token is context
  only).
* perplexity = exp(sum of the negative log-likelihoods / number of predictions), natural log,
  log-probabilities computed in float32 from the model's logits.
"""
from __future__ import annotations

import gzip
import lzma
import math
import os
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..devices import model_device, resolve_device
from ..progress import bar as progress_bar
from .calib import max_positions, spread
from .checkpoint import check_safetensors_files
from .errors import ModelError

PRECISIONS = ("fp8", "bf16")


class EvalInputError(ModelError):
    """Bad input to an evaluation: a text too short for one window, a bad window length..."""


@dataclass
class PerplexityResult:
    """What ``perplexity`` measured; ``to_json`` is what ``escha eval --json`` prints."""

    perplexity: float
    nll: float  # mean negative log-likelihood per predicted token, nats
    predicted_tokens: int
    windows: int  # windows evaluated
    available_windows: int  # floor(text_tokens / seq_len)
    seq_len: int
    text_tokens: int
    tokens_from: str = "tokenizer"  # or "bytes" (the checkpoint has no tokenizer)
    seconds: float = 0.0
    device: str = "cpu"  # where the model ran

    def to_json(self) -> dict:
        """Every field, as a JSON-serializable dict."""
        return asdict(self)


def read_text(path: str | os.PathLike) -> str:
    """A UTF-8 text file (``.gz`` and ``.xz`` are decompressed), or a one-line error."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"text file not found: {path}")
    opener = gzip.open if path.endswith(".gz") else lzma.open if path.endswith(".xz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise EvalInputError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except (OSError, lzma.LZMAError) as e:
        raise EvalInputError(f"{path} cannot be read: {e}") from None


def encode_text(text: str, tokenizer, vocab_size: int) -> tuple[torch.Tensor, str]:
    """The text as one 1-D int64 token stream, without special tokens, and where the ids came from."""
    if tokenizer is None:
        return torch.tensor([b % vocab_size for b in text.encode("utf-8")], dtype=torch.int64), "bytes"
    # verbose=False: a long text is meant to exceed the model's context; it is windowed below.
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64), "tokenizer"


def window_starts(n_tokens: int, seq_len: int, max_windows: int | None = None) -> tuple[list[int], int]:
    """Start offsets of the windows evaluated, and how many full windows the text holds."""
    if seq_len < 2:
        raise EvalInputError(f"--seq-len must be at least 2, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise EvalInputError(f"--max-windows must be at least 1, got {max_windows}")
    available = n_tokens // seq_len
    if available == 0:
        raise EvalInputError(f"the text has {n_tokens} tokens, fewer than one window of --seq-len {seq_len}")
    idx = spread(available, available if max_windows is None else max_windows)
    return [i * seq_len for i in idx], available


def _forward_kwargs(model: nn.Module) -> dict:
    import inspect
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


@torch.no_grad()
def perplexity(model: nn.Module, ids: torch.Tensor, seq_len: int = 2048, *, max_windows: int | None = None,
               batch_size: int = 1, progress: bool | None = False, tokens_from: str = "tokenizer") -> PerplexityResult:
    """Perplexity of a causal LM over a 1-D token stream (windowing as in the module docstring).

    Args:
        model: a transformers causal LM (anything whose output has ``.logits`` [B, L, V]).
        ids: 1-D int64 tokens of the whole text.
        seq_len: window length L (tokens per forward pass).
        max_windows: evaluate at most this many windows, evenly spaced; None for all.
        batch_size: windows per forward pass (memory only; the result does not depend on it
            beyond floating-point rounding).
        progress: a progress bar on stderr: True, False, or None for "when stderr is a terminal".
        tokens_from: recorded in the result ("tokenizer" or "bytes").
    """
    if ids.dim() != 1:
        raise EvalInputError(f"token ids must be 1-D, got shape {list(ids.shape)}")
    if batch_size < 1:
        raise EvalInputError(f"batch size must be at least 1, got {batch_size}")
    n_pos = max_positions(getattr(model, "config", None))
    if n_pos is not None and seq_len > n_pos:
        raise EvalInputError(f"--seq-len {seq_len} exceeds the model's {n_pos} positions (max_position_embeddings)")
    starts, available = window_starts(ids.numel(), seq_len, max_windows)
    device = model_device(model)
    extra = _forward_kwargs(model)
    total_nll, count = 0.0, 0
    t0 = time.perf_counter()
    with progress_bar(len(starts), "perplexity", progress, unit="window") as bar:
        for b in range(0, len(starts), batch_size):
            batch = torch.stack([ids[s:s + seq_len] for s in starts[b:b + batch_size]]).to(device)
            logits = model(input_ids=batch, **extra).logits
            for row in range(batch.shape[0]):  # one window at a time: float32 logits of a window only
                lp = torch.log_softmax(logits[row, :-1].float(), dim=-1)
                nll = -lp.gather(-1, batch[row, 1:, None]).squeeze(-1)
                total_nll += float(nll.double().sum())
                count += nll.numel()
            del logits
            bar.set_postfix_str(f"ppl {math.exp(total_nll / count):.3f}", refresh=False)
            bar.update(batch.shape[0])
    mean = total_nll / count
    return PerplexityResult(math.exp(mean), mean, count, len(starts), available, seq_len, ids.numel(),
                            tokens_from, time.perf_counter() - t0, str(device))


# -- model directories --------------------------------------------------------------------------
def is_escha_dir(model_dir: str) -> bool:
    """Whether config.json carries an escha ``quantization_config``."""
    from .loading import read_config_json
    try:
        qc = read_config_json(model_dir).get("quantization_config")
    except (OSError, ValueError):  # ModelError is a ValueError
        return False
    from .output import QUANT_METHOD
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype | None:
    """"auto"/None: the checkpoint's dtype on a GPU, float32 on a CPU (fast there, and exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else None
    dt = getattr(torch, str(dtype), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise EvalInputError(f"--dtype must name a torch floating dtype (or auto), got {dtype!r}")
    return dt


def load_for_eval(model_dir: str | os.PathLike, device: str | torch.device | None = None,
                  dtype: str | torch.dtype | None = "auto", precision: str | None = None):
    """(model in eval mode, tokenizer or None) for a plain HF causal LM or an escha-quantized one.

    Escha directories load through ``escha.load_model``; ``precision`` ("fp8", "bf16") is then
    set on every EschaLinear (None keeps escha.matmul's default, fp8 for long inputs). Plain
    checkpoints load through ``AutoModelForCausalLM.from_pretrained`` (``precision`` ignored).
    """
    from .loading import read_config_json
    model_dir = os.fspath(model_dir)
    read_config_json(model_dir)  # a missing directory or a config.json that is no JSON object: one line
    if precision is not None and precision not in PRECISIONS:
        raise EvalInputError(f"--precision must be one of {PRECISIONS}, got {precision!r}")
    device = resolve_device(device, "--device")
    dt = resolve_dtype(dtype, device)
    check_safetensors_files(model_dir)  # a truncated or foreign file is named, whichever loader runs
    if is_escha_dir(model_dir):
        from ..nn.linear import set_matmul_precision
        from .loading import load_model
        model = load_model(model_dir, device=device, dtype=dt)
        set_matmul_precision(model, precision)
    else:
        from transformers import AutoModelForCausalLM
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt if dt is not None else "auto",
                                                         local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"{model_dir} cannot be loaded as a causal LM: {str(e).splitlines()[0]}") from None
        model = model.to(device).eval()
    from .pipeline import _load_tokenizer
    return model, _load_tokenizer(model_dir)


def evaluate_dir(model_dir: str | os.PathLike, text_path: str | os.PathLike, seq_len: int = 2048, *,
                 max_windows: int | None = None, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = "auto", precision: str | None = None,
                 batch_size: int = 1, progress: bool | None = False) -> PerplexityResult:
    """Perplexity of the model in ``model_dir`` on the text file ``text_path`` (``escha eval``).

    ``device`` None: CUDA when torch sees a GPU, else the CPU.
    """
    if seq_len < 2:
        raise EvalInputError(f"--seq-len must be at least 2, got {seq_len}")
    text = read_text(text_path)
    model, tokenizer = load_for_eval(model_dir, device, dtype, precision)
    ids, source = encode_text(text, tokenizer, model.config.vocab_size)
    return perplexity(model, ids, seq_len, max_windows=max_windows, batch_size=batch_size,
                      progress=progress, tokens_from=source)
