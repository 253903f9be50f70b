"""``escha bench``: the measurement method as a tool (docs/BENCH.md).

Wire into a CLI with ``escha.bench.add_parser(subparsers)``; the parser sets ``func=run``.
"""
from __future__ import annotations

from .cli import add_arguments, add_parser, check_args, main, run

__all__ = ["add_arguments", "add_parser", "check_args", "main", "run"]
