"""torch.nn modules for Escha W2 weights."""
from .linear import EschaLinear, dense_linear, replace_linear, set_matmul_path, set_matmul_precision
from .norms import FoldedNorm, fold_norms, fuse_projections
from .shared import SharedInput, share_inputs
from .parallel import (ColumnParallelEschaLinear, ColumnParallelLinear, RowParallelEschaLinear, RowParallelLinear,
                       TPGroup)

__all__ = ["EschaLinear", "replace_linear", "set_matmul_path", "set_matmul_precision", "dense_linear",
           "ColumnParallelEschaLinear", "RowParallelEschaLinear", "ColumnParallelLinear", "RowParallelLinear",
           "TPGroup", "SharedInput", "share_inputs", "FoldedNorm", "fold_norms", "fuse_projections"]
