"""torch.nn modules for Escha W2 weights."""
from .linear import EschaLinear, dense_linear, replace_linear, set_matmul_path

__all__ = ["EschaLinear", "replace_linear", "set_matmul_path", "dense_linear"]
