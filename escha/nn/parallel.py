"""Tensor-parallel linear layers (the Megatron split) over torch.distributed.

A column-parallel layer holds a block of output rows (its shard of q/k/v, gate/up) and returns
its slice of the output, which stays sharded; a row-parallel layer holds the matching block of
input columns (o, down), multiplies the sharded activation and sums the ranks' partial products
with one all-reduce, then adds the bias once. Both split on 128-block boundaries
(``escha.format.shard``), Escha and dense weights alike, so that neighbours always agree on which
rows a rank holds. Communication is ``torch.distributed.all_reduce`` on the given group (gloo on
CPU, NCCL on GPUs); nothing else is exchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..format.qweight import QuantizedWeight
from ..format.shard import ShardPlan, shard_plan, shard_shape
from .linear import EschaLinear


@dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: this process's ``rank`` among ``world_size`` ranks of ``group``.

    ``group`` None is the default (world) process group.
    """

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None

    @classmethod
    def current(cls, group: dist.ProcessGroup | None = None) -> "TPGroup":
        """The group of the initialised default process group (or of ``group``)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call torch.distributed.init_process_group first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)


def all_reduce_(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sum ``y`` over the ranks of ``tp`` (in place when contiguous); returns the sum."""
    if tp.world_size > 1:
        # A product cropped from its padded width is a strided view; collectives need dense memory.
        y = y.contiguous()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=tp.group)
    return y


class _Parallel:
    """What both split directions record: the group, the block plan and the global shape."""

    tp: TPGroup
    shard: ShardPlan
    global_shape: tuple[int, int]
    PARALLEL_DIM: int

    def _setup(self, in_features: int, out_features: int, tp: TPGroup,
               parts: Sequence[int] | None) -> tuple[int, int]:
        self.tp = tp
        self.global_shape = (int(out_features), int(in_features))
        self.shard = shard_plan(self.global_shape, self.PARALLEL_DIM, tp.rank, tp.world_size, parts)
        out, in_ = shard_shape(self.global_shape, self.shard)
        return in_, out  # this rank's slice

    def _tp_repr(self) -> str:
        return (f", tp={self.tp.rank}/{self.tp.world_size} of {self.global_shape[0]}x{self.global_shape[1]}"
                f", blocks={list(self.shard.blocks)}")


def _local_bias(bias: torch.Tensor | None, plan: ShardPlan, dim: int) -> torch.Tensor | None:
    """A column-parallel layer's bias is sliced like its rows; a row-parallel layer keeps all of it."""
    if bias is None or dim == 1:
        return bias
    return bias.detach()[plan.index().to(bias.device)]


class ParallelEschaLinear(_Parallel, EschaLinear):
    """An EschaLinear holding one rank's block of a weight split along ``PARALLEL_DIM``.

    ``in_features``/``out_features`` given to the constructor are the global sizes; the module's
    own ``in_features``/``out_features`` are its local slice, and ``parts`` splits a fused
    dimension ([q | k | v], [gate | up]) part by part.
    """

    PARALLEL_DIM: int

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp: TPGroup,
                 parts: Sequence[int] | None = None, **kwargs) -> None:
        local_in, local_out = self._setup(in_features, out_features, tp, parts)
        EschaLinear.__init__(self, local_in, local_out, bias=bias, **kwargs)

    @classmethod
    def from_full(cls, qw: QuantizedWeight, bias: torch.Tensor | None, tp: TPGroup,
                  parts: Sequence[int] | None = None) -> "ParallelEschaLinear":
        """This rank's shard of a whole weight (and bias) held in memory."""
        mod = cls(qw.in_features, qw.out_features, bias=bias is not None, tp=tp, parts=parts,
                  bits=qw.bits, codebook_id=qw.codebook_id, device="meta")
        shard = qw.shard(cls.PARALLEL_DIM, tp.rank, tp.world_size, parts)
        # Copies, so that the whole weight's memory is freed once the caller drops it.
        mod.set_qweight(shard.clone())
        if bias is not None:
            mod.bias = nn.Parameter(_local_bias(bias, mod.shard, cls.PARALLEL_DIM).clone().to(qw.device),
                                    requires_grad=False)
        return mod

    def extra_repr(self) -> str:
        return super().extra_repr() + self._tp_repr()


class ColumnParallelEschaLinear(ParallelEschaLinear):
    """This rank's output rows of an EschaLinear: y_local = x @ W_rows^T + b_rows, no communication.

    The output is this rank's slice of the features (the heads it owns, its share of the MLP).
    """

    PARALLEL_DIM = 0


class RowParallelEschaLinear(ParallelEschaLinear):
    """This rank's input columns of an EschaLinear: y = all_reduce(x_local @ W_cols^T) + b.

    The input is this rank's slice of the activation (what the column-parallel layers before it
    produce); the output is whole on every rank. The bias is added after the sum, once.
    """

    PARALLEL_DIM = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., local in] -> the summed product [..., out] (+ bias), in x's dtype."""
        y = all_reduce_(self._product(x), self.tp)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


class ParallelLinear(_Parallel, nn.Linear):
    """A dense nn.Linear holding one rank's block, split on the same 128-blocks as the Escha layers
    (so that a dense layer and an Escha neighbour agree on which rows a rank holds)."""

    PARALLEL_DIM: int

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp: TPGroup,
                 parts: Sequence[int] | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        local_in, local_out = self._setup(in_features, out_features, tp, parts)
        nn.Linear.__init__(self, local_in, local_out, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_full(cls, linear: nn.Linear, tp: TPGroup, parts: Sequence[int] | None = None) -> "ParallelLinear":
        """This rank's shard of a whole nn.Linear held in memory."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, tp=tp, parts=parts,
                  device="meta", dtype=w.dtype)
        index = mod.shard.index().to(w.device)
        mod.weight = nn.Parameter(w.detach().index_select(cls.PARALLEL_DIM, index).contiguous(),
                                  requires_grad=False)
        if linear.bias is not None:
            mod.bias = nn.Parameter(_local_bias(linear.bias, mod.shard, cls.PARALLEL_DIM).clone(),
                                    requires_grad=False)
        return mod

    def extra_repr(self) -> str:
        return super().extra_repr() + self._tp_repr()


class ColumnParallelLinear(ParallelLinear):
    """This rank's output rows of a dense nn.Linear: y_local = x @ W_rows^T + b_rows."""

    PARALLEL_DIM = 0


class RowParallelLinear(ParallelLinear):
    """This rank's input columns of a dense nn.Linear: y = all_reduce(x_local @ W_cols^T) + b."""

    PARALLEL_DIM = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., local in] -> the summed product [..., out] (+ bias)."""
        y = all_reduce_(nn.functional.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


PARALLEL_CLASSES: dict[tuple[bool, int], type] = {
    (True, 0): ColumnParallelEschaLinear, (True, 1): RowParallelEschaLinear,
    (False, 0): ColumnParallelLinear, (False, 1): RowParallelLinear,
}
