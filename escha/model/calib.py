"""Calibration text: a small built-in set, and turning text into token samples."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

# Varied registers (prose, code, dialogue, numbers, lists) so that Hessians see more than one
# kind of token statistics. Used when no calibration file is given.
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


def read_calibration(path: str | None) -> list[str]:
    """Paragraphs of a UTF-8 text file (split on blank lines), or the built-in set."""
    if path is None:
        return list(BUILTIN_TEXT)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"calibration file not found: {path}") from None
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not parts:
        raise ValueError(f"calibration file {path} holds no text")
    return parts


def text_digest(texts: list[str]) -> str:
    """A short hash of the calibration text (part of a run's identity for resuming)."""
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:16]


@dataclass
class TokenSamples:
    """Calibration inputs: one [1, L] int64 tensor per forward pass."""

    samples: list[torch.Tensor]
    source: str  # "tokenizer" or "bytes" (no tokenizer in the checkpoint)

    @property
    def tokens(self) -> int:
        return sum(s.numel() for s in self.samples)


def tokenize(texts: list[str], tokenizer, vocab_size: int, causal: bool, seq_len: int,
             max_samples: int) -> TokenSamples:
    """Turn text into samples.

    Decoders: all text joined (separated by EOS) and cut into ``seq_len``-token chunks, so
    attention sees long contexts. Encoders: one sample per paragraph with the tokenizer's special
    tokens, truncated to ``seq_len``. Without a tokenizer, UTF-8 bytes modulo the vocabulary
    stand in for tokens (enough to exercise every weight, and deterministic).
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    if tokenizer is not None:
        encode = lambda t, special: list(tokenizer(t, add_special_tokens=special)["input_ids"])  # noqa: E731
        eos = getattr(tokenizer, "eos_token_id", None)
        source = "tokenizer"
    else:
        encode = lambda t, special: [b % vocab_size for b in t.encode("utf-8")]  # noqa: E731
        eos = None
        source = "bytes"
    out: list[torch.Tensor] = []
    if causal:
        stream: list[int] = []
        for t in texts:
            stream += encode(t, False) + ([eos] if eos is not None else [])
        for i in range(0, len(stream), seq_len):
            chunk = stream[i:i + seq_len]
            if len(chunk) >= min(8, seq_len) or not out:
                out.append(torch.tensor([chunk], dtype=torch.int64))
    else:
        for t in texts:
            ids = encode(t, True)[:seq_len]
            if ids:
                out.append(torch.tensor([ids], dtype=torch.int64))
    if not out:
        raise ValueError("calibration text produced no tokens")
    return TokenSamples(out[:max_samples], source)
