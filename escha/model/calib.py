"""Calibration text: the shipped English corpus (or a user's file), and turning text into samples."""
from __future__ import annotations

import functools
import hashlib
import lzma
import os
from dataclasses import dataclass

import torch

from .errors import ModelError

# The default calibration corpus (package data; escha/model/data/README.md says what it holds):
# about 790k tokens of English from the Python documentation, the Jargon File and The Devil's
# Dictionary, interleaved so that any stretch of it mixes the registers.
CORPUS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calib_en.txt.xz")
# Bumped whenever the way text becomes samples changes, so that partial results of an older
# scheme are not resumed (it is part of text_digest).
SAMPLING_SCHEME = "2: paragraphs joined by blank lines; chunks evenly spaced over the stream"

# Varied registers (prose, code, dialogue, numbers, lists) so that Hessians see more than one
# kind of token statistics. Used only when the shipped corpus is missing from an installation.
BUILTIN_TEXT: tuple[str, ...] = (
    "The committee postponed its decision until the engineers could explain why the bridge had started to sway in light wind.",
    "def mean(values):\n    return sum(values) / len(values) if values else 0.0",
    "She poured the tea, looked out at the rain over the harbour, and decided the letter could wait until morning.",
    "In 1969 the first humans walked on the Moon; the mission lasted eight days, three hours and eighteen minutes.",
    "Photosynthesis converts light energy into chemical energy, storing it in the bonds of glucose molecules.",
    "Q: How many legs does a spider have? A: Eight, attached to the cephalothorax.",
    "To reset the router, hold the button on the back for ten seconds until the lights blink amber.",
    "The recipe calls for two cups of flour, a pinch of salt, one egg and enough cold water to bind the dough.",
    "Inflation rose to 3.2 percent in March, driven mainly by energy prices and the cost of housing.",
    "SELECT name, COUNT(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC;",
    "The cat knocked the glass off the table, watched it shatter, and then walked away as if nothing had happened.",
    "Quantum entanglement links the states of two particles so that measuring one constrains the other.",
    "Dear Ms. Alvarez, thank you for your application; we would like to invite you to an interview next Tuesday.",
    "Mountains in the north receive heavy snowfall, while the southern plains stay dry for most of the year.",
    "for (int i = 0; i < n; ++i) { total += weights[i] * inputs[i]; }",
    "He trained for months, but on race day a cramp in the twentieth mile forced him to walk the rest of the way.",
    "The Treaty of Westphalia in 1648 ended the Thirty Years' War and reshaped the map of Europe.",
    "A prime number has exactly two divisors: one and itself. The first few are 2, 3, 5, 7, 11 and 13.",
    "Please remember to water the plants, feed the fish and lock the back door before you leave.",
    "The orchestra tuned to the oboe's A, and the hall fell silent as the conductor raised her baton.",
    "Neural networks learn by adjusting weights to reduce a loss function, usually with gradient descent.",
    "Volcanic soil is rich in minerals, which is why vineyards often thrive on the slopes of old volcanoes.",
    "\"Where were you last night?\" she asked. \"At the library,\" he said, which was only partly true.",
    "Rust's borrow checker ensures that references never outlive the data they point to.",
    "The museum's new wing displays ceramics from the Tang dynasty alongside contemporary glass sculpture.",
    "Step 1: preheat the oven to 180 C. Step 2: grease the tin. Step 3: bake for forty minutes.",
    "Coral reefs cover less than one percent of the ocean floor yet support about a quarter of marine species.",
    "The defendant's lawyer argued that the evidence had been collected without a valid warrant.",
    "Wir treffen uns morgen um acht Uhr am Bahnhof, und dann fahren wir zusammen in die Berge.",
    "Le petit village se trouve au bord de la rivière, entouré de champs de lavande et de vieux moulins.",
    "The spacecraft's ion engine produces a tiny thrust, but over months it changes the orbit dramatically.",
    "Sorting a list of n items by comparison needs on the order of n log n steps in the worst case.",
)


@functools.lru_cache(maxsize=1)
def _corpus_paragraphs(path: str) -> tuple[str, ...]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return tuple(p.strip() for p in f.read().split("\n\n") if p.strip())


def default_calibration() -> tuple[list[str], str]:
    """The shipped corpus as paragraphs, and its name; the built-in sentences if it is missing."""
    if os.path.isfile(CORPUS_PATH):
        return list(_corpus_paragraphs(CORPUS_PATH)), "corpus calib_en.txt.xz"
    return list(BUILTIN_TEXT), "built-in sentences (the corpus file is missing)"


def read_calibration(path: str | None) -> list[str]:
    """Paragraphs of a UTF-8 text file (split on blank lines), or of the default corpus.

    A missing file raises FileNotFoundError; a directory, an unreadable or non-UTF-8 file, or
    one holding only whitespace raises ModelError, each one line naming the file.
    """
    if path is None:
        return default_calibration()[0]
    if os.path.isdir(path):
        raise ModelError(f"calibration file {path} is a directory; expected a UTF-8 text file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"calibration file not found: {path}") from None
    except UnicodeDecodeError as e:
        raise ModelError(f"calibration file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ModelError(f"calibration file {path} cannot be read: {e.strerror or e}") from None
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not parts:
        raise ModelError(f"calibration file {path} holds no text")
    return parts


def text_digest(texts: list[str]) -> str:
    """A short hash of the calibration text (part of a run's identity for resuming)."""
    return hashlib.sha256("\x00".join([SAMPLING_SCHEME, *texts]).encode()).hexdigest()[:16]


@dataclass
class TokenSamples:
    """Calibration inputs: one [1, L] int64 tensor per forward pass."""

    samples: list[torch.Tensor]
    source: str  # "tokenizer" or "bytes" (no tokenizer in the checkpoint)

    @property
    def tokens(self) -> int:
        """Total tokens over all samples."""
        return sum(s.numel() for s in self.samples)


def spread(n: int, k: int) -> list[int]:
    """``k`` indices out of ``range(n)``, evenly spaced from the first (all of them if k >= n)."""
    if k >= n:
        return list(range(n))
    return [i * n // k for i in range(k)]


def max_positions(config) -> int | None:
    """The longest sequence a model's position embeddings allow, where its config says."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def calibration_seq_len(config, seq_len: int) -> int:
    """``seq_len``, shortened to the model's maximum number of positions."""
    n = max_positions(config)
    return min(seq_len, n) if n is not None else seq_len


def tokenize(texts: list[str], tokenizer, vocab_size: int, causal: bool, seq_len: int,
             max_samples: int) -> TokenSamples:
    """Turn text into samples.

    Decoders: the paragraphs joined by blank lines, as the text reads, tokenized as one stream
    and cut into ``seq_len``-token chunks (a last chunk shorter than 8 tokens is dropped); when
    there are more chunks than ``max_samples``, that many are taken evenly spaced over the
    stream, so that a sample of a long corpus covers all of it. Encoders: one sample per
    paragraph with the tokenizer's special tokens, truncated to ``seq_len``, likewise spaced.
    Without a tokenizer, UTF-8 bytes modulo the vocabulary stand in for tokens (enough to
    exercise every weight, and deterministic).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if tokenizer is not None:
        encode = lambda t, special: list(tokenizer(t, add_special_tokens=special)["input_ids"])  # noqa: E731
        source = "tokenizer"
    else:
        encode = lambda t, special: [b % vocab_size for b in t.encode("utf-8")]  # noqa: E731
        source = "bytes"
    out: list[torch.Tensor] = []
    if causal:
        stream: list[int] = []
        for i, t in enumerate(texts):
            # Paragraph by paragraph, each but the first led by its separator: a long corpus is
            # never one oversized tokenizer call, and byte-level BPE tokenizers (which split
            # whitespace from the word after it) give exactly the tokens of the joined text.
            stream += encode("\n\n" + t if i else t, False)
        chunks = [stream[i:i + seq_len] for i in range(0, len(stream), seq_len)]
        chunks = [c for j, c in enumerate(chunks) if len(c) >= min(8, seq_len) or j == 0]
        for j in spread(len(chunks), max_samples):
            out.append(torch.tensor([chunks[j]], dtype=torch.int64))
    else:
        for j in spread(len(texts), max_samples):
            ids = encode(texts[j], True)[:seq_len]
            if ids:
                out.append(torch.tensor([ids], dtype=torch.int64))
    if not out:
        raise ValueError("calibration text produced no tokens")
    return TokenSamples(out, source)
