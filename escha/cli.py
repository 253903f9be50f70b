"""The ``escha`` command line: demo, quantize, eval, bench."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _add_subcommands(sub: argparse._SubParsersAction) -> None:
    from . import bench, demo
    from .model import cli as model_cli
    from .model import eval_cli
    for module in (demo, model_cli, eval_cli, bench):
        module.add_parser(sub)


def _interpret_without_gpu() -> None:
    """Run Triton kernels in Triton's CPU interpreter when there is no GPU.

    Triton reads TRITON_INTERPRET when it is first imported, so this must run before anything
    imports it (building the parser does). Only the demo asks for it: it exists to show the
    kernels at work anywhere; model quantization on a CPU is faster on the reference path.
    """
    import os

    import torch
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(prog="escha", description="Escha W2: 2-bit trellis-coded LLM weights")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"escha {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_subcommands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``escha`` script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        _interpret_without_gpu()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # commands with something to say about it (quantize) catch it first
        print(f"\nescha {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
