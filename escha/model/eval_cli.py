"""``escha eval``: perplexity of a model directory on a text file."""
from __future__ import annotations

import argparse
import json
import sys

WINDOWS = ("The text is tokenized as one stream (no special tokens) and cut into floor(T / SEQ_LEN) "
           "non-overlapping windows from its first token (a partial last window is dropped); "
           "--max-windows K keeps K of them, evenly spaced over the text. Each window is evaluated "
           "from an empty context, predicting its tokens 2..SEQ_LEN; the perplexity is "
           "exp(total negative log-likelihood / number of predicted tokens).")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``eval`` subcommand."""
    p = subparsers.add_parser(
        "eval", help="perplexity of a model directory (bf16/fp16 or escha-quantized) on a text file",
        description="Perplexity of a causal language model directory, a plain Hugging Face checkpoint "
                    "or one written by `escha quantize`, on a UTF-8 text file. " + WINDOWS)
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local model directory (config.json + safetensors)")
    p.add_argument("--text", metavar="FILE", required=True,
                   help="UTF-8 text to evaluate on (.gz and .xz are decompressed)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per window (default 2048)")
    p.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="evaluate N windows evenly spaced over the text (default: all)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when torch sees a GPU, else cpu)")
    p.add_argument("--dtype", default="auto",
                   help="activation dtype: auto (the checkpoint's on a GPU, float32 on a CPU), bfloat16, ...")
    p.add_argument("--precision", choices=("fp8", "bf16"), default=None,
                   help="escha models: escha.matmul's precision (default: its dispatch, fp8 for prompts "
                        "longer than 64 tokens); ignored for plain checkpoints")
    p.add_argument("--batch-size", type=int, default=1, help="windows per forward pass (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line of text")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar (drawn on stderr, and only when stderr is a terminal)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``escha eval``; returns the exit code (2 with a one-line message on bad input)."""
    from ..devices import DeviceError
    from ..format.qweight import FormatError
    from ..progress import wanted
    from .errors import ModelError
    from .evaluate import evaluate_dir

    progress = False if args.quiet else None  # None: a bar when stderr is a terminal
    if not wanted(progress):
        try:  # transformers' own loading bars, likewise
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except ImportError:
            pass
    try:
        res = evaluate_dir(args.model_dir, args.text, args.seq_len, max_windows=args.max_windows,
                           device=args.device, dtype=args.dtype, precision=args.precision,
                           batch_size=args.batch_size, progress=progress)
    except (ModelError, FormatError, DeviceError, FileNotFoundError) as e:
        print(f"escha eval: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model_dir": args.model_dir, "text": args.text, "precision": args.precision,
                          **res.to_json()}))
    else:
        note = " (UTF-8 bytes as tokens: the checkpoint has no tokenizer)" if res.tokens_from == "bytes" else ""
        print(f"perplexity {res.perplexity:.4f} over {res.predicted_tokens:,} predicted tokens "
              f"({res.windows} of {res.available_windows} windows of {res.seq_len}){note}")
    return 0
