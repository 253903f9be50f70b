"""``escha quantize``: the command line of the model pipeline."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from typing import Iterator

PROG = "escha quantize"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the ``quantize`` subcommand."""
    p = subparsers.add_parser(
        "quantize", help="quantize a Hugging Face safetensors checkpoint to Escha W2",
        description="Quantize the Linear layers of a local Hugging Face safetensors checkpoint, layer "
                    "by layer with Hessians from calibration text, into an HF-style model directory. "
                    "An interrupted run (Ctrl-C) resumes from its finished layers when rerun.")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="local HF model directory (config.json + safetensors)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (resumes from OUT_DIR/.partial)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bits", type=int, choices=(2, 3), default=None, help="K for every Linear (default 2)")
    g.add_argument("--bpw", type=float, default=None,
                   help="target mean bits per weight; K in {2,3} per Linear by measured sensitivity")
    p.add_argument("--calib", metavar="FILE", default=None,
                   help="UTF-8 calibration text (paragraphs split on blank lines); default: the English "
                        "corpus shipped with escha (about 790k tokens). Text like the model's own use is "
                        "worth more: on SmolLM2-135M, in-domain text cut K=3 perplexity by 11%%, K=2 by 21%%")
    p.add_argument("--skip", default="", metavar="LIST",
                   help="comma-separated module names or globs left unquantized, in addition to lm_head "
                        "(a pattern that matches no Linear is reported)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize lm_head too (by default it stays as stored; a tied head always does)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sign vectors (default 0)")
    p.add_argument("--device", default=None,
                   help="torch device for calibration and encoding (default: cuda when torch sees a GPU, "
                        "else cpu)")
    p.add_argument("--seq-len", type=int, default=2048,
                   help="tokens per calibration sample (default 2048, shortened to the model's maximum positions)")
    p.add_argument("--samples", type=int, default=128,
                   help="calibration samples, evenly spaced over the text (default 128: 262k tokens at 2048; "
                        "lower both on a CPU to save time)")
    p.add_argument("--encoder", choices=("viterbi", "greedy"), default=None,
                   help="trellis encoder (default: escha.quantize's, the exact Viterbi)")
    p.add_argument("--no-hessian", action="store_true",
                   help="quantize without LDLQ (Hessians still measure the error); faster on CPU")
    p.add_argument("--tune-steps", type=int, default=None, metavar="N",
                   help="after quantizing, train the row scales and norm weights for N steps (one calibration "
                        "sample each) against the reference model's next-token distributions, keeping what does "
                        "best on held-out samples; causal LMs; holds the reference and a dense copy of the "
                        "quantized model in memory (default: 256 on a GPU where that fits, else 0; 0 turns it off)")
    p.add_argument("--tune-lr", type=float, default=1e-3, help="Adam's learning rate on log(row scale) "
                   "for --tune-steps (default 1e-3)")
    p.add_argument("--restart", action="store_true", help="discard partial results in OUT_DIR/.partial")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in OUT_DIR")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar, notes, table or summary (errors and warnings only); the bar is "
                        "drawn only when stderr is a terminal anyway")
    p.set_defaults(func=run)
    return p


def skip_list(skip: str, quantize_lm_head: bool) -> tuple[str, ...]:
    """The modules left unquantized: lm_head (unless ``quantize_lm_head``) and the --skip patterns."""
    from .options import DEFAULT_SKIP
    base = () if quantize_lm_head else DEFAULT_SKIP
    extra = tuple(s.strip() for s in skip.split(",") if s.strip())
    return base + tuple(dict.fromkeys(s for s in extra if s not in base))


@contextlib.contextmanager
def one_line_warnings(prog: str, quiet: bool = False) -> Iterator[None]:
    """Show warnings as ``prog: warning: message`` lines (notes for slow-work estimates) on stderr.

    ``quiet`` drops the notes; warnings stay.
    """
    from ..progress import SlowWorkWarning

    def show(message, category, filename, lineno, file=None, line=None):
        slow = issubclass(category, SlowWorkWarning)
        if not (slow and quiet):
            print(f"{prog}: {'note' if slow else 'warning'}: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", SlowWorkWarning)
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        yield


def _partial_layers(out_dir: str) -> int:
    from .store import PARTIAL_DIR
    folder = os.path.join(out_dir, PARTIAL_DIR)
    return sum(f.endswith(".safetensors") for f in os.listdir(folder)) if os.path.isdir(folder) else 0


def run(args: argparse.Namespace) -> int:
    """Run ``escha quantize``; returns the exit code (2 with a one-line message on bad input,
    130 when interrupted)."""
    from ..devices import DeviceError, resolve_device
    from ..format.qweight import FormatError
    from .errors import ModelError
    from .options import QuantizeOptions
    from .pipeline import quantize_model
    from .store import PARTIAL_DIR

    try:
        with one_line_warnings(PROG, args.quiet):
            options = QuantizeOptions(
                bits=args.bits if args.bits is not None else 2, bpw=args.bpw, calib=args.calib,
                skip=skip_list(args.skip, args.quantize_lm_head), seed=args.seed,
                device=str(resolve_device(args.device, "--device")), seq_len=args.seq_len,
                max_samples=args.samples, encoder=args.encoder, use_hessian=not args.no_hessian,
                tune_steps=args.tune_steps, tune_lr=args.tune_lr,
                progress=False if args.quiet else None)
            report = quantize_model(args.model_dir, args.out_dir, options, restart=args.restart,
                                    overwrite=args.overwrite)
    except (ModelError, FormatError, DeviceError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        done = _partial_layers(args.out_dir)
        if not done and os.path.isfile(os.path.join(args.out_dir, "config.json")):
            what = (f"{args.out_dir} holds the quantized model, complete, its scale tuning not finished; "
                    "run the same command with --overwrite to quantize and tune again, or use it as it is")
        elif done:
            what = (f"{done} finished layer(s) are kept in {os.path.join(args.out_dir, PARTIAL_DIR)}; "
                    "run the same command again to resume from them")
        else:
            what = "no layer was finished yet; run the same command again to start over"
        print(f"\n{PROG}: interrupted: {what}", file=sys.stderr)
        return 130
    if not args.quiet:
        print(report.table())
        for line in report.summary():
            print(line)
        print(f"wrote {args.out_dir} (report: {os.path.join(args.out_dir, 'escha_report.json')})")
    return 0
