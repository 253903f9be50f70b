"""Projections that read one input, run as one product: [q | k | v] or [gate | up] in one call.

Weights quantized together (``escha.quant.quantize_shared``; ``escha quantize`` does it for every
set of Linears that read the same tensor) have one set of input signs and one global scale, so
their rows stack into one weight (``escha.format.shard.concat_rows``). A ``SharedInput`` holds
such EschaLinears: the first of them called with an input computes the stacked product (one input
transform, one GEMM over all their rows, one output transform: a third of the launches, and a
GEMM wide enough to fill the GPU where k and v alone are not), and each member returns its rows
of it. The members' weight buffers become views of the stacked tensors, so the weights are held
once.

The product is reused only by members called with the very tensor it was computed from (same
object, unmodified), before every member has taken its rows; a member called with another input
while others still wait means the members do not share their input after all, and the group
stops sharing for good (each member then runs alone, as an EschaLinear does). Traced code
(``torch.compile``) keeps the grouping with the stack the last eager call built: it cannot
restack, so members whose buffers were replaced since then (a move, an assignment) run alone
there until an eager call restacks them.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..format.qweight import TENSOR_NAMES
from ..format.shard import ShardError, concat_rows, row_offsets, split_rows
from .linear import EschaLinear, HeadNormCache, capturing, matmul_with, write_count


class SharedInput:
    """EschaLinears over one input whose product is computed once for all of them."""

    def __init__(self, members: Sequence[EschaLinear]) -> None:
        if len(members) < 2:
            raise ValueError(f"a shared input needs at least two EschaLinears, got {len(members)}")
        self.members = list(members)
        self.widths = [m.out_features for m in self.members]
        self.offsets = row_offsets(self.widths)
        self.diverged = False
        self._key: tuple | None = None
        self._merged = None
        self._x: torch.Tensor | None = None
        self._x_version = -1
        self._y: torch.Tensor | None = None
        self._pending: set[int] = set()
        self._head_norms = HeadNormCache()
        self._settings: tuple | None = None  # (path, precision, input norm) of the traced product
        self._alone: set[int] = set()  # members traced code found replaced since the stacking
        self._build()  # raises ShardError when the weights were not quantized together
        for i, m in enumerate(self.members):
            m._shared, m._shared_index = self, i
        self.note_norms()

    def note_norms(self) -> None:
        """Record the members' folded per-head norms, which the product reads here. Eager calls
        record them afresh; traced code reads them here rather than through the member list, so
        whatever sets a member's ``_output_norm`` calls it after (``fold_norms`` does). Norms of
        different epsilons cannot share one output transform."""
        self._output_norms = tuple(m._output_norm for m in self.members)
        self._norms_agree = len({n.variance_epsilon for n in self._output_norms if n is not None}) <= 1

    def _buffer_key(self) -> tuple:
        # Identity and version of every member buffer (a move or an in-place load changes them),
        # and the members' replacement counts, which traced code compares. Eager code only (traced
        # code never restacks), so write_count's compile check is left out and the version is read
        # inline: every group's first call of an eager step makes this key.
        key = []
        for m in self.members:
            bufs = m._buffers
            for n in TENSOR_NAMES:
                t = bufs[n]
                key.append((id(t), None if t.is_inference() else t._version))
        key.extend(m._generation for m in self.members)
        return tuple(key)

    def _build(self) -> None:
        """Stack the members' weights; each member then holds views of the stack."""
        merged = concat_rows([m.qweight for m in self.members])
        for m, part in zip(self.members, split_rows(merged, self.widths)):
            m.set_qweight(part)  # its buffers become views of the stack; part is its weight
        self._merged = merged
        self._alone = set()
        self._key = self._buffer_key()
        self._generations = tuple(m._generation for m in self.members)

    def merged(self, key: tuple | None = None):
        """The stacked QuantizedWeight, rebuilt if a member's buffers were moved or rewritten
        (``key``: the current ``_buffer_key()``, when the caller has it)."""
        if (self._buffer_key() if key is None else key) != self._key:
            self._build()
        return self._merged

    def product(self, member: EschaLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``member``'s x @ W^T (no bias) taken from the shared product, or None when it must run alone."""
        if torch.compiler.is_compiling():
            return self._traced_product(member, x)
        if self.diverged:
            return None
        self.note_norms()  # eager code sees a norm set or cleared without fold_norms too
        settings = {(m.path, m.precision, id(m._input_norm)) for m in self.members}
        if len(settings) != 1 or not self._norms_agree:
            return None  # members asked for different paths, precisions or norms
        i = member._shared_index
        same = self._y is not None and x is self._x and write_count(x) == self._x_version
        if self._pending and not same:
            self._stop()  # another input while members still wait for this one: no shared input
            return None
        if not same or i not in self._pending:
            key = self._buffer_key()
            if key != self._key and capturing():
                return None  # restacking copies the weights: never inside a CUDA graph being captured
            try:
                qw = self.merged(key)
            except ShardError:
                self._stop()  # the members' weights were replaced by ones not quantized together
                return None
            self._y = matmul_with(x, qw, member.path, member.precision, member.input_norm,
                                  self._head_norms.get(self.widths, self._output_norms))
            self._x, self._x_version = x, write_count(x)
            self._pending = set(range(len(self.members)))
        return self._take(i)

    def _traced_product(self, member: EschaLinear, x: torch.Tensor) -> torch.Tensor | None:
        """``product`` in traced code (torch.compile). It cannot restack, so it takes the stack as
        the last eager call left it, for members whose buffers are still the ones stacked (their
        replacement count unchanged). It reads the calling member and this object only, never the
        member list: every object traced code reaches by a second route costs one more guard,
        checked at each call of the compiled step (docs/KERNELS.md, "Guards of a compiled step").
        A member whose settings differ from those of the product computed for this input runs alone."""
        if self.diverged:
            return None
        i = member._shared_index
        same = self._y is not None and x is self._x
        if self._pending and not same:
            self._stop()
            return None
        settings = (member.path, member.precision, member._input_norm)
        if member._generation != self._generations[i]:
            self._alone.add(i)  # replaced: it runs alone, and no product waits for it (a count only grows)
        if i in self._alone or (same and settings != self._settings) or not self._norms_agree:
            self._take(i)  # the member runs alone
            return None
        if not same or i not in self._pending:
            self._y = matmul_with(x, self._merged, member.path, member.precision, member.input_norm,
                                  self._head_norms.get(self.widths, self._output_norms))
            self._x, self._settings = x, settings
            self._pending = set(range(len(self.widths))) - self._alone
        return self._take(i)

    def _take(self, i: int) -> torch.Tensor | None:
        """Member ``i``'s rows of the product (None when none is held); the product is dropped
        once no member waits for it."""
        self._pending.discard(i)
        off = self.offsets[i]
        y = None if self._y is None else self._y[..., off:off + self.widths[i]]
        if not self._pending:
            self._x, self._y, self._settings = None, None, None
        return y

    def _stop(self) -> None:
        self.diverged = True
        self._x, self._y, self._pending = None, None, set()


def share_inputs(model: nn.Module) -> int:
    """Group the EschaLinears of ``model`` that were quantized together into ``SharedInput`` s.

    Candidates are sibling EschaLinears (children of one module, e.g. q_proj, k_proj, v_proj) of
    the same class, input width, K, codebook and device with equal input signs and global scale:
    the mark of ``quantize_shared``. Returns the number of groups formed; members already in a
    group are left as they are. ``escha.load_model`` calls it.
    """
    groups = 0
    for parent in model.modules():
        free = [m for m in parent.children() if isinstance(m, EschaLinear) and m._shared is None]
        while len(free) >= 2:
            first = free[0]
            members = [m for m in free if type(m) is type(first) and _same_input(first, m)]
            free = [m for m in free if m not in members]
            if len(members) >= 2:
                SharedInput(members)
                groups += 1
    return groups


def _same_input(a: EschaLinear, b: EschaLinear) -> bool:
    if a is b:
        return True
    if (a.in_features, a.bits, a.codebook_id) != (b.in_features, b.bits, b.codebook_id):
        return False
    sa, sb = a._buffers["sv"], b._buffers["sv"]
    ga, gb = a._buffers["gscale"], b._buffers["gscale"]
    if sa.device != sb.device or sa.device.type == "meta":
        return False
    return bool(torch.equal(sa, sb) and torch.equal(ga, gb))
