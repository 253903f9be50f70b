"""Test-wide set-up: without a GPU, Triton kernels run in Triton's CPU interpreter.

The variable must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), so it is set here, before test modules import escha.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
