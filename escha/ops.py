"""escha.matmul: y = x @ W_hat^T for an Escha W2 weight, dispatched to a kernel path."""
from __future__ import annotations

import torch

from .format.codec import matmul_reference
from .format.qweight import QuantizedWeight

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_inputs(x: object, qw: object) -> None:
    """Raise a TypeError/ValueError naming the problem if (x, qw) cannot be multiplied."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x dtype {x.dtype} is not supported; use float16, bfloat16 or float32")
    if x.dim() < 1 or x.shape[-1] != qw.in_features:
        raise ValueError(f"x has inner dimension {x.shape[-1] if x.dim() else None}, "
                         f"but the weight expects {qw.in_features} (weight shape {qw.shape})")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qw.device}; move one with .to()")


def matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T, returned in x's dtype.

    NaN or Inf in x propagate to y as they would through torch.matmul.
    """
    check_inputs(x, qw)
    y = matmul_reference(x.reshape(-1, x.shape[-1]), qw)
    return y.to(x.dtype).reshape(*x.shape[:-1], qw.out_features)
