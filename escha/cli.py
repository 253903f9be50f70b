"""The ``escha`` command line: demo, quantize, bench."""
from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _add_subcommands(sub: argparse._SubParsersAction) -> None:
    from . import demo
    demo.add_parser(sub)
    # Optional subcommands register themselves when their modules import cleanly.
    for module in ("escha.model.cli", "escha.bench"):
        try:
            mod = __import__(module, fromlist=["add_parser"])
        except ImportError:
            continue
        if hasattr(mod, "add_parser"):
            mod.add_parser(sub)


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
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
