"""Benchmark scripts imported from their files for the tests (benchmarks/ is not a package)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module, registered under its name (dataclasses look their module
    up while the file executes, and scripts import one another by name)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
