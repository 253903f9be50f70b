#!/usr/bin/env python3
"""Reproduce escha's matmul benchmark: the same entry point as ``escha bench``.

    python benchmarks/bench_matmul.py --out benchmarks/results/h200 [--shapes ...] [--m ...] [--arms ...]
"""
import sys
from pathlib import Path

# Run from a checkout without installing: the repository root holds the escha package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from escha.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
