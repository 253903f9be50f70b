"""``escha quantize``: the command line of the model pipeline."""
from __future__ import annotations

import argparse
import os
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``quantize`` subcommand."""
    p = subparsers.add_parser(
        "quantize", help="quantize a Hugging Face safetensors checkpoint to Escha W2",
        description="Quantize the Linear layers of a local Hugging Face safetensors checkpoint, layer "
                    "by layer with Hessians from calibration text, into an HF-style model directory.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local HF model directory (config.json + safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (resumes from OUT_DIR/.partial)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bits", type=int, choices=(2, 3), default=None, help="K for every Linear (default 2)")
    g.add_argument("--bpw", type=float, default=None,
                   help="target mean bits per weight; K in {2,3} per Linear by measured sensitivity")
    p.add_argument("--calib", metavar="FILE", default=None,
                   help="UTF-8 calibration text (paragraphs split on blank lines); default: the English "
                        "corpus shipped with escha (about 790k tokens)")
    p.add_argument("--skip", default="lm_head",
                   help="comma-separated module names or globs left unquantized (default: lm_head; '' for none)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sign vectors")
    p.add_argument("--device", default="cpu", help="torch device for calibration and encoding (e.g. cuda)")
    p.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per calibration sample (default 2048, shortened to the model's maximum positions)")
    p.add_argument("--samples", type=int, default=128,
                   help="calibration samples, evenly spaced over the text (default 128: 262k tokens at 2048; "
                        "lower both on a CPU to save time)")
    p.add_argument("--encoder", choices=("viterbi", "greedy"), default=None,
                   help="trellis encoder (default: escha.quantize's, the exact Viterbi)")
    p.add_argument("--no-hessian", action="store_true",
                   help="quantize without LDLQ (Hessians still measure the error); faster on CPU")
    p.add_argument("--restart", action="store_true", help="discard partial results in OUT_DIR/.partial")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    p.add_argument("--quiet", action="store_true", help="no progress bar or table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``escha quantize``; returns the exit code (2 with a message on bad input)."""
    from .errors import ModelError
    from .options import QuantizeOptions
    from .pipeline import quantize_model

    try:
        options = QuantizeOptions(
            bits=args.bits if args.bits is not None else 2, bpw=args.bpw, calib=args.calib,
            skip=tuple(s.strip() for s in args.skip.split(",")), seed=args.seed, device=args.device,
            seq_len=args.seq_len, max_samples=args.samples, encoder=args.encoder,
            use_hessian=not args.no_hessian, progress=not args.quiet)
        report = quantize_model(args.model_dir, args.out_dir, options, restart=args.restart,
                                overwrite=args.overwrite)
    except (ModelError, FileNotFoundError) as e:
        print(f"escha quantize: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(report.table())
        print(f"wrote {args.out_dir} (report: {os.path.join(args.out_dir, 'escha_report.json')})")
    return 0
