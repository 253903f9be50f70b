"""Slices of a QuantizedWeight on 128-block boundaries: the tensor-parallel shards of one checkpoint.

The incoherence transforms Hn and Hk are block-diagonal over 128-blocks (docs/FORMAT.md, section
5), so the rows (or columns) of W_pad inside a run of whole 128-blocks depend only on the matching
rows of T, su and scale (or columns of T and sv), and the global scale is shared: a block-aligned
slice of the stored tensors is itself a valid weight, with no re-quantization.

A shard's logical size is the part of the original range that its blocks cover: a dimension of
``n`` weights has ``ceil(n / 128)`` blocks, every rank gets the same number of whole blocks, and
only the rank holding the last block (whose tail is padding) has fewer than ``128 * blocks`` real
rows. A fused dimension (``parts``, e.g. [q | k | v] or [gate | up]) is split part by part, each
rank taking its slice of every part, concatenated in part order.

The converse holds too: weights over the same input with equal input signs and global scale,
stacked block-aligned by rows (``concat_rows``), form one valid weight whose rows are theirs (the
padding rows of all but the last sit between them). Projections that read one input (q, k, v;
gate, up) quantized that way (``escha.quant.quantize_shared``) run as one product.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .spec import HAD_BLOCK

if TYPE_CHECKING:
    from .qweight import QuantizedWeight, TensorSpec


class ShardError(ValueError):
    """A weight that cannot be split as asked on 128-block boundaries."""


@dataclass(frozen=True)
class ShardPlan:
    """Which 128-blocks of one dimension a rank holds.

    Attributes:
        dim: 0 (output rows) or 1 (input columns).
        blocks: half-open ranges of block indices in the padded dimension, in the order the shard
            concatenates them (one range, or one per part of a fused dimension).
        ranges: the same ranges in logical rows/columns, cropped to the original size: the rows
            of the original weight (and of its bias) that the shard holds, in order.
    """

    dim: int
    blocks: tuple[tuple[int, int], ...]
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        """The shard's logical length along ``dim``."""
        return sum(b - a for a, b in self.ranges)

    def index(self) -> torch.Tensor:
        """The original indices the shard holds along ``dim`` (int64), for slicing dense tensors."""
        return torch.cat([torch.arange(a, b) for a, b in self.ranges])


def _blocks(n: int) -> int:
    return -(-n // HAD_BLOCK)


def _part_blocks(size: int, parts: Sequence[int] | None, what: str) -> list[tuple[int, int]]:
    """Each part's (first block, block count); parts start on block boundaries."""
    parts = [size] if parts is None else [int(p) for p in parts]
    if any(p < 1 for p in parts) or sum(parts) != size:
        raise ShardError(f"{what}: parts {parts} must be positive and sum to {size}")
    out, start = [], 0
    for i, p in enumerate(parts):
        if i < len(parts) - 1 and p % HAD_BLOCK:
            raise ShardError(f"{what}: part {i} has {p} rows, not a multiple of {HAD_BLOCK}, so the next part "
                             f"does not start on a Hadamard block")
        out.append((start // HAD_BLOCK, _blocks(p)))
        start += p
    return out


def supported_degrees(size: int, parts: Sequence[int] | None = None) -> list[int]:
    """Every world size that splits a dimension of ``size`` (fused as ``parts``) on block boundaries."""
    g = 0
    for _, n in _part_blocks(size, parts, f"dimension of {size}"):
        g = math.gcd(g, n)
    return [d for d in range(1, g + 1) if g % d == 0]


def shard_plan(shape: Sequence[int], dim: int, rank: int, world_size: int,
               parts: Sequence[int] | None = None) -> ShardPlan:
    """The blocks rank ``rank`` of ``world_size`` holds along ``dim`` of an [out, in] weight.

    ``parts`` (sizes summing to ``shape[dim]``) describes a fused dimension; each part but the
    last must be a whole number of blocks. Raises ShardError when a part's blocks do not divide
    by ``world_size`` or when ``rank`` is out of range.
    """
    if dim not in (0, 1):
        raise ShardError(f"dim must be 0 (rows) or 1 (columns), got {dim!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ShardError(f"world_size must be a positive integer, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ShardError(f"rank must be an integer, got {type(rank).__name__} {rank!r}")
    if not 0 <= rank < world_size:
        raise ShardError(f"rank {rank} is outside world size {world_size}")
    size = int(shape[dim])
    what = f"{'rows' if dim == 0 else 'columns'} of a {shape[0]}x{shape[1]} weight"
    blocks, ranges = [], []
    for first, n in _part_blocks(size, parts, what):
        if n % world_size:
            raise ShardError(f"cannot split the {what} over {world_size} ranks: a part of {n} Hadamard blocks "
                             f"of {HAD_BLOCK} does not divide by {world_size} (supported: "
                             f"{', '.join(map(str, supported_degrees(size, parts)))})")
        per = n // world_size
        a, b = first + rank * per, first + (rank + 1) * per
        blocks.append((a, b))
        ranges.append((a * HAD_BLOCK, min(b * HAD_BLOCK, size)))
    return ShardPlan(dim, tuple(blocks), tuple(ranges))


def take(spec: "TensorSpec", plan: ShardPlan, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    """Stored tensor ``spec`` of the shard, where ``read(index)`` returns the tensor at a tuple of slices.

    ``read`` may index a tensor or a safetensors slice (``safe_open(...).get_slice(key)``), which
    reads only the bytes the index selects. Which axes a slice cuts is ``spec.axes``.
    """
    for axis, follows in enumerate(spec.axes):
        if follows is not None and follows[0] == plan.dim:
            pieces = []
            for a, b in plan.blocks:
                index = [slice(None)] * len(spec.axes)
                index[axis] = slice(a * HAD_BLOCK // follows[1], b * HAD_BLOCK // follows[1])
                pieces.append(read(tuple(index)))
            return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=axis)).contiguous()
    return read(tuple(slice(None) for _ in spec.axes))


def shard_shape(shape: Sequence[int], plan: ShardPlan) -> tuple[int, int]:
    """The logical [out, in] of the shard of a weight of ``shape``."""
    out = [int(shape[0]), int(shape[1])]
    out[plan.dim] = plan.size
    return out[0], out[1]


def row_offsets(out_features: Sequence[int]) -> list[int]:
    """Where each weight's rows start in their ``concat_rows``: after the padded rows of those before."""
    offsets, start = [], 0
    for n in out_features:
        offsets.append(start)
        start += _blocks(int(n)) * HAD_BLOCK
    return offsets


def concat_rows(qws: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
    """One weight whose rows are those of ``qws`` in order, each starting on a 128-block.

    Every weight must read the same input: equal ``in_features``, K, codebook, input signs ``sv``
    and global scale ``g``. The result's logical rows are the padded rows of all but the last
    weight, then the last one's rows; weight i's rows are ``[row_offsets(...)[i], + out_i)``, bit for
    bit (the trellis, su and scale rows are copied; nothing is re-quantized).
    """
    from .qweight import QuantizedWeight
    if not qws:
        raise ShardError("concat_rows needs at least one weight")
    first = qws[0]
    for i, qw in enumerate(qws[1:], 1):
        same = (qw.in_features == first.in_features and qw.bits == first.bits and qw.codebook_id == first.codebook_id
                and qw.device == first.device)
        if not same:
            raise ShardError(f"weight {i} ({qw.shape}, K={qw.bits}, codebook {qw.codebook_id}, {qw.device}) does not "
                             f"read the input of weight 0 ({first.shape}, K={first.bits}, codebook "
                             f"{first.codebook_id}, {first.device})")
        if not (torch.equal(qw.sv, first.sv) and torch.equal(qw.gscale, first.gscale)):
            raise ShardError(f"weight {i} has other input signs or another global scale than weight 0: only "
                             f"weights quantized together (escha.quant.quantize_shared) stack into one")
    rows = [spec.name for spec in QuantizedWeight.TENSORS if spec.axes[0] is not None and spec.axes[0][0] == 0]
    tensors = [torch.cat([getattr(q, spec.name) for q in qws]) if spec.name in rows else getattr(first, spec.name)
               for spec in QuantizedWeight.TENSORS]
    out = row_offsets([q.out_features for q in qws])[-1] + qws[-1].out_features
    return QuantizedWeight.trusted(tensors, (out, first.in_features), first.bits, first.codebook_id)


def split_rows(qw: "QuantizedWeight", out_features: Sequence[int]) -> list["QuantizedWeight"]:
    """The weights of ``out_features`` rows each that ``concat_rows`` stacked into ``qw`` (views of
    its tensors, no copies): the inverse of ``concat_rows``."""
    from .qweight import QuantizedWeight
    offsets = row_offsets(out_features)
    if not out_features or offsets[-1] + int(out_features[-1]) != qw.out_features:
        raise ShardError(f"rows {list(out_features)}, each padded to whole {HAD_BLOCK}-blocks but the last, "
                         f"do not make the {qw.out_features} rows of the weight")
    parts = []
    for start, n in zip(offsets, out_features):
        b0 = start // HAD_BLOCK
        plan = ShardPlan(0, ((b0, b0 + _blocks(int(n))),), ((start, start + int(n)),))
        tensors = [take(spec, plan, getattr(qw, spec.name).__getitem__) for spec in QuantizedWeight.TENSORS]
        parts.append(QuantizedWeight.trusted(tensors, (int(n), qw.in_features), qw.bits, qw.codebook_id))
    return parts
