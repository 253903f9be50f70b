"""Test-wide set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), so it is set here, before test modules import escha.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module: tiny matrices gain nothing from threads, and on a busy
    2-core runner threads oversubscribe (a model test ran 25x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
