"""EschaLinear: a drop-in replacement for torch.nn.Linear holding an Escha W2 weight."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .. import ops
from ..format.qweight import TENSOR_NAMES, QuantizedWeight
from ..format.spec import check_bits
from ..norm import HEAD, HeadNorm, RowNorm


class EschaLinear(nn.Module):
    """y = x @ W_hat^T + b, with W_hat stored as an Escha W2 QuantizedWeight.

    Attributes mirror nn.Linear (``in_features``, ``out_features``, ``bias``). The weight lives in
    buffers named and typed as ``QuantizedWeight.TENSORS`` declares (trellis, su, sv, scale,
    gscale), so .to(), state_dict() and checkpoints see them: casting the module (``.half()``,
    ``.to(torch.bfloat16)``) changes only the bias, and moving it (``.to(device)``) moves
    everything. ``forward`` calls ``escha.matmul``.

    Args:
        in_features, out_features: the weight's shape [out, in]; positive ints.
        bias: whether the layer adds a bias (a Parameter of ``out_features``, frozen like the weight).
        bits: K, bits per weight of the trellis (1, 2, 3 or 4).
        codebook_id: the registered codebook the trellis states decode through (0: 3INST, the one
            the kernels implement).
        device: where the buffers (placeholder values until a weight is loaded) and the bias live.
        dtype: the bias's dtype; the weight's buffers keep their format dtypes.
        path: the ``escha.matmul`` kernel path to force (a ``KernelPath`` or its name); None lets
            the dispatcher choose. A forced path wins over ``precision``.
        precision: ``escha.matmul``'s precision, ``"fp8"`` or ``"bf16"``; None keeps its default
            (fp8). A per-module attribute rather than a global switch: two models in one process
            can differ.

    Training: forward supports backward to its input (escha.matmul's gradient with respect to x),
    so adapters can be fine-tuned on a frozen layer; the quantized weight gets no gradient.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, bits: int = 2,
                 codebook_id: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, path: str | None = None,
                 precision: str | None = None) -> None:
        super().__init__()
        for name, v in (("in_features", in_features), ("out_features", out_features), ("codebook_id", codebook_id)):
            if isinstance(v, bool) or not isinstance(v, int):  # int() would truncate 128.5 silently
                raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if in_features < 1 or out_features < 1:
            raise ValueError(f"features must be positive, got in={in_features}, out={out_features}")
        check_bits(bits)
        # Checked here, not at the first forward (where a precision would be ignored under a path).
        ops._check_choice(path, ops.Precision.FP8 if precision is None else precision, None)
        self.path = path  # escha.matmul kernel path; None lets the dispatcher choose
        self.precision = precision  # escha.matmul's precision; None keeps its default
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.bits = int(bits)
        self.codebook_id = int(codebook_id)
        # Placeholder values that form a valid weight (signs +1, unit scales); loading replaces them.
        placeholder = QuantizedWeight.placeholder((self.out_features, self.in_features), self.bits,
                                                  self.codebook_id, device)
        for name, t in placeholder.tensors().items():
            self.register_buffer(name, t)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self._cache_key: tuple | None = None
        self._cache: QuantizedWeight | None = None
        # Counts replacements of the weight's buffers (set_qweight, a move, an assignment, or a
        # buffer written into _buffers and seen by the next eager qweight read): traced
        # code compares it with the count a SharedInput stacked, an int guard where comparing the
        # buffers themselves would be five tensor guards (docs/KERNELS.md, "Guards of a compiled step").
        self._generation = 0
        self._shared = None  # the SharedInput this layer belongs to (escha.nn.shared), if any
        self._shared_index = -1
        # The FoldedNorm whose RMSNorm this layer applies to its input (escha.nn.norms), if any:
        # set without registering it as a submodule, so that it is saved once, where the model has it.
        object.__setattr__(self, "_input_norm", None)
        # Likewise the FoldedNorm of the per-head RMSNorm applied to this layer's output (Qwen3's
        # q_norm, k_norm), and the HeadNorm built from it.
        object.__setattr__(self, "_output_norm", None)
        self._head_norms = HeadNormCache()

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_quantized(cls, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> "EschaLinear":
        """Wrap an existing QuantizedWeight (and optional bias [out]); shares qw's tensors."""
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"expected a QuantizedWeight, got {type(qw).__name__}")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor [{qw.out_features}] or None, got {type(bias).__name__}")
        if bias is not None and tuple(bias.shape) != (qw.out_features,):
            raise ValueError(f"bias must have shape [{qw.out_features}], got {list(bias.shape)}")
        mod = cls(qw.in_features, qw.out_features, bias=bias is not None, bits=qw.bits,
                  codebook_id=qw.codebook_id, device="meta")
        mod.set_qweight(qw)
        if bias is not None:
            mod.bias = nn.Parameter(bias.detach().clone().to(qw.device), requires_grad=False)
        return mod

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int = 2, hessian: torch.Tensor | None = None,
                    seed: int = 0, **quantize_kwargs) -> "EschaLinear":
        """Quantize an nn.Linear's weight with ``escha.quantize`` and keep its bias.

        ``hessian`` is E[x x^T] [in, in] over the layer's inputs, for Hessian-aware encoders;
        ``quantize_kwargs`` go to ``escha.quantize`` as they are (e.g. ``encoder="greedy"``).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"expected an nn.Linear, got {type(linear).__name__}")
        from .. import quant
        qw = quant.quantize(linear.weight.detach(), bits=bits, hessian=hessian, seed=seed, **quantize_kwargs)
        return cls.from_quantized(qw, None if linear.bias is None else linear.bias.detach())

    def set_qweight(self, qw: QuantizedWeight) -> None:
        """Replace the stored weight by ``qw`` (same shape); the module adopts its tensors."""
        if not isinstance(qw, QuantizedWeight):
            raise TypeError(f"expected a QuantizedWeight, got {type(qw).__name__}")
        if (qw.out_features, qw.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {qw.shape} does not match the module's "
                             f"({self.out_features}, {self.in_features})")
        for name, t in qw.tensors().items():
            self._buffers[name] = t
        self._generation += 1
        self.bits, self.codebook_id = qw.bits, qw.codebook_id
        self._cache_key, self._cache = self._weight_key(), qw  # qw is the weight over these buffers

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name in TENSOR_NAMES:  # a buffer assigned (load_state_dict(assign=True) does it too)
            self._generation += 1

    def _weight_key(self) -> tuple:
        return tuple(id(self._buffers[n]) for n in TENSOR_NAMES) + (self.bits, self.codebook_id)

    # -- the weight ---------------------------------------------------------------------
    @property
    def qweight(self) -> QuantizedWeight:
        """The QuantizedWeight over the current buffers (validated once per buffer change)."""
        if torch.compiler.is_compiling():
            bufs = tuple(self._buffers[n] for n in TENSOR_NAMES)
            # Traced code builds the weight from the buffers alone: reading the cache would add a
            # guard for each buffer's identity and the cache's every field, checked on each call of
            # the compiled step (docs/KERNELS.md, "Guards of a compiled step"). The buffers were
            # validated when they were set (set_qweight) or are checked by shape, dtype and device here.
            return QuantizedWeight.trusted(bufs, (self.out_features, self.in_features), self.bits, self.codebook_id)
        key = self._weight_key()
        if key != self._cache_key or self._cache is None:
            if key != self._cache_key:
                self._generation += 1  # a buffer written into _buffers directly, seen here
            self._cache = QuantizedWeight(*(self._buffers[n] for n in TENSOR_NAMES),
                                          shape=(self.out_features, self.in_features),
                                          bits=self.bits, codebook_id=self.codebook_id)
            self._cache_key = key
        return self._cache

    def dequantized_weight(self) -> torch.Tensor:
        """W_hat [out, in] in float32 (for inspection and tests; forward never builds it)."""
        from ..format.codec import dequantize
        return dequantize(self.qweight)

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight, side information included."""
        return self.qweight.bits_per_weight

    @property
    def input_norm(self) -> RowNorm | None:
        """The RMSNorm this layer applies to its input first (``escha.nn.fold_norms``), or None."""
        return None if self._input_norm is None else self._input_norm.row_norm()

    @property
    def head_norm(self) -> HeadNorm | None:
        """The per-head RMSNorm this layer applies to its output (``escha.nn.fold_norms``), or None."""
        return None if self._output_norm is None else self._head_norms.get([self.out_features], [self._output_norm])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W_hat^T through escha.matmul, with this layer's path or precision (and input and head
        norms); no bias. A layer in a SharedInput takes its rows of the product computed once for
        the group."""
        if self._shared is not None:
            y = self._shared.product(self, x)
            if y is not None:
                return y
        return matmul_with(x, self.qweight, self.path, self.precision, self.input_norm, self.head_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> x @ W_hat^T (+ bias), in x's dtype, through escha.matmul
        (differentiable with respect to x; the quantized weight is frozen)."""
        y = self._product(x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[override]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._shared is not None:  # views of the group's stacked weight: saved as tensors of their own
            for name in TENSOR_NAMES:
                destination[prefix + name] = destination[prefix + name].clone()

    # -- device and dtype moves -----------------------------------------------------------
    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        # Module.to(dtype) would cast the fp16/fp32 scales; move the format buffers by device only.
        held = {n: self._buffers.pop(n) for n in TENSOR_NAMES}
        try:
            super()._apply(fn, recurse)
        finally:
            src = held["trellis"].device
            target = fn(torch.empty(0, dtype=torch.int8, device=src)).device
            for n, t in held.items():
                if t.device == target:
                    moved = t
                elif t.device.type == "meta":
                    moved = torch.empty_like(t, device=target)  # to_empty() from a meta skeleton
                else:
                    moved = t.to(target)
                self._buffers[n] = moved
            if any(self._buffers[n] is not t for n, t in held.items()):  # a cast moves none
                self._generation += 1
                self._cache_key, self._cache = None, None
        return self

    def extra_repr(self) -> str:
        """The shape, bias and bits, and the forced path or precision if any (for print(module))."""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, bits={self.bits}"
                + ("" if self.path is None else f", path={self.path!r}")
                + ("" if self.precision is None else f", precision={self.precision!r}"))


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def write_count(t: torch.Tensor) -> int | None:
    """The tensor's in-place write counter (inference tensors keep none)."""
    if torch.compiler.is_compiling() or t.is_inference():
        return None  # traced code keeps no counter (a compiled step writes no member input in place)
    return t._version


class HeadNormCache:
    """The HeadNorm of the stacked output of some EschaLinears (rows of each padded to whole
    128-blocks but the last): the blocks of a layer with a folded head norm flagged and given its
    weight, the others not; None when none has one.

    Kept while the norms' weights stay the same tensors, unchanged (a move or a cast keeps the
    Parameter object but not its data, hence storage and dtype in the key). Built with device ops
    only, so a CUDA graph may capture the building, but then not kept: tensors made inside a
    capture live in the graph's pool.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: HeadNorm | None = None

    def get(self, out_features: Sequence[int], norms: Sequence) -> HeadNorm | None:
        """The HeadNorm of stacked outputs of these widths whose folded norms are ``norms`` (None
        when none has one), kept while the norm weights stay unchanged."""
        if torch.compiler.is_compiling():
            # Traced code cannot key on storage: it builds the norm in the graph (a few small ops).
            return None if all(n is None for n in norms) else head_norm_of(out_features, norms)
        key = tuple(None if n is None else (id(n.weight), n.weight.data_ptr(), n.weight.dtype, write_count(n.weight))
                    for n in norms)
        if key == self._key:
            return self._value
        value = None if all(n is None for n in norms) else head_norm_of(out_features, norms)
        if not capturing():
            self._key, self._value = key, value
        return value


def head_norm_of(out_features: Sequence[int], norms: Sequence) -> HeadNorm:
    """The HeadNorm of stacked outputs of these widths (each padded to whole 128-blocks) whose
    folded per-head norms are ``norms`` (None where a part has none; at least one has one)."""
    ref = next(n for n in norms if n is not None)
    weights, flags = [], []
    for width, n in zip(out_features, norms):
        blocks = -(-width // HEAD)
        if n is None:
            weights.append(torch.zeros(blocks * HEAD, dtype=ref.weight.dtype, device=ref.weight.device))
            flags.append(torch.zeros(blocks, dtype=torch.int8, device=ref.weight.device))
        else:
            weights.append(n.weight.to(ref.weight.dtype).repeat(blocks))
            flags.append(torch.ones(blocks, dtype=torch.int8, device=ref.weight.device))
    return HeadNorm(torch.cat(weights), torch.cat(flags), ref.variance_epsilon)


def matmul_with(x: torch.Tensor, qw: QuantizedWeight, path: str | None, precision: str | None,
                norm: RowNorm | None, head_norm: HeadNorm | None = None) -> torch.Tensor:
    """escha.matmul with a layer's settings: a forced path wins over a precision."""
    kwargs = {} if norm is None else {"norm": norm}
    if head_norm is not None:
        kwargs["head_norm"] = head_norm
    if path is not None:
        return ops.matmul(x, qw, path=path, **kwargs)
    return ops.matmul(x, qw, **kwargs) if precision is None else ops.matmul(x, qw, precision=precision, **kwargs)


def set_matmul_path(model: nn.Module, path: str | None) -> int:
    """Force ``escha.matmul``'s path (e.g. "reference") in every EschaLinear of ``model``; returns the count.
    An unknown path raises ValueError here, before any module changes."""
    ops._check_choice(path, ops.Precision.FP8, None)
    n = 0
    for m in model.modules():
        if isinstance(m, EschaLinear):
            m.path = path
            n += 1
    return n


def set_matmul_precision(model: nn.Module, precision: str | None) -> int:
    """Set ``escha.matmul``'s precision ("fp8", "bf16", or None for the default) in every
    EschaLinear of ``model``; returns the count. A forced path (set_matmul_path) still wins."""
    from ..ops import _PRECISION_CODE, Precision
    if precision is not None and precision not in _PRECISION_CODE:
        raise ValueError(f"unknown precision {precision!r}; choose one of {[p.value for p in Precision]}")
    n = 0
    for m in model.modules():
        if isinstance(m, EschaLinear):
            m.precision = None if precision is None else str(Precision(precision))
            n += 1
    return n


def dense_linear(qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    """An nn.Linear holding W_hat = dequantize(qw): exactly the quantized function, in ``dtype``.

    Calibration runs quantized layers this way: the result does not depend on which GEMM kernel
    a device has, and on CPU it is much faster than emulated kernels.
    """
    from ..format.codec import dequantize
    with torch.device("meta"):
        lin = nn.Linear(qw.in_features, qw.out_features, bias=bias is not None)
    lin.weight = nn.Parameter(dequantize(qw).to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return lin


def replace_linear(parent: nn.Module, name: str, new: nn.Module) -> None:
    """Set ``parent.<name>`` (a dotted path below ``parent``) to ``new``."""
    owner_path, _, attr = name.rpartition(".")
    owner = parent.get_submodule(owner_path) if owner_path else parent
    setattr(owner, attr, new)
