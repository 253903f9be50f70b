"""escha.matmul: y = x @ W_hat^T for an Escha W2 weight, dispatched to a kernel path.

Paths (``KernelPath``) and the op each runs (``dispatch_table()``):
    reference     plain PyTorch through the transform domain (escha.format), fp32 math.
    decode        the portable decode GEMM (escha.kernels.decode, tl.dot), for few rows (M <= 64).
    decode-wgmma  the register-operand decode GEMM for Hopper (escha.kernels.decode_wgmma, Gluon);
                  what the rule's decode range runs where it can (sm_90, K = 2 or 3).
    prefill       the fused kernel: trellis decoded inside an fp8 tensor-core GEMM.
    dequant-fp8   dequantize once to an fp8 scratch, then torch._scaled_mm (row-wise scales).
    dequant-bf16  dequantize once to a bf16 scratch, then a bf16 matmul: the accuracy-first path.
    dequant-core-fp8, dequant-core-bf16  dequantize the plain core T (no Hadamard product), one
                  library GEMM, then Hn and the row scales in one pass over its output: the
                  dequantize-once form for fewer rows (DispatchRule.dequant_path).
    decode-fp8    the decode GEMM on the fp8 tensor cores for Hopper (escha.kernels.decode_fp8,
                  Gluon): e4m3 weights and activations, token blocks of up to 256; what the
                  rule runs past the decode range up to DispatchRule.fp8_decode_max_m (256),
                  where it can (sm_90, K = 2 or 3).

Every op has the shape ``op(x, qw, *, config=None)`` and picks its own launch configuration by
its rule; adding a path is one ``KernelPath`` member and one entry in ``dispatch_table``.

The kernels (and Triton) are imported on first use, not by ``import escha``: Triton decides
whether kernels run in its CPU interpreter when they are defined, so ``escha demo`` must be able
to set TRITON_INTERPRET after importing escha and before the first kernel is defined.

Which path runs is a pure function of (M, precision, DispatchRule): ``DispatchRule.choose``. The
rule's numbers come from the measured crossovers in benchmarks/results/prefill.md. A caller
overrides it per call (``rule=``, ``path=``, ``precision=``); a layer that wants another precision
passes its own argument on every call. There is deliberately no global or context-managed
setting: an argument is thread-safe without locks, visible to torch.compile as a constant, and
cannot leak from one layer or request into another.

Where the kernels run: on CUDA tensors always. On CPU only when the Triton kernels were created in
interpreter mode (TRITON_INTERPRET=1 set before escha is imported); otherwise every CPU call takes
the reference path, whatever path was asked for, since compiled Triton kernels cannot run there.

The entry point is the custom op ``escha::matmul`` (x, the weight's stored tensors as
``QuantizedWeight.TENSORS`` declares them, then ints), with a fake implementation, so it works
under torch.compile(fullgraph=True) and inside CUDA-graph capture: nothing in it synchronizes
with the host or copies from host memory. Its backward gives x's gradient (the quantized weight is
frozen) in the transform domain, through ``escha::decode_core`` (the core T, by the dequant
kernel on a GPU), an op of its own so that a compiled backward need not trace the decoders, called
on runs of whole 128-row blocks so that its memory stays small whatever the weight's size. A plain
eager call (no compiler, tracer, dispatch mode, profiler or gradient involved) runs the same
implementation without the op's dispatch, which costs as much host time as the kernels' launches
at a few tokens.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .format.codec import matmul_reference
from .format.qweight import TENSOR_NAMES, QuantizedWeight
from .format.spec import HAD_BLOCK, padded
from .norm import HEAD, HeadNorm, RowNorm


class KernelPath(str, enum.Enum):
    """A way of computing escha.matmul; the value is the name benchmarks and logs use."""

    REFERENCE = "reference"
    DECODE = "decode"
    PREFILL = "prefill"
    DEQUANT_FP8 = "dequant-fp8"
    DEQUANT_BF16 = "dequant-bf16"
    DECODE_WGMMA = "decode-wgmma"
    DEQUANT_CORE_FP8 = "dequant-core-fp8"  # new paths go last: the custom op's path codes are positions
    DEQUANT_CORE_BF16 = "dequant-core-bf16"
    DECODE_FP8 = "decode-fp8"

    def __str__(self) -> str:
        return self.value

    @property
    def fp8_operands(self) -> bool:
        """Whether the path's GEMM multiplies e4m3 operands (relative error ~4e-2 against the
        16-bit paths' ~2e-3: docs/KERNELS.md, prefill tolerance table)."""
        return self in (KernelPath.PREFILL, KernelPath.DEQUANT_FP8, KernelPath.DEQUANT_CORE_FP8, KernelPath.DECODE_FP8)


class Precision(str, enum.Enum):
    """Operand precision of the GEMM: fp8 e4m3 (fast) or bf16 (accuracy-first)."""

    FP8 = "fp8"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


def reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The reference codec's product (fp32 math), returned in x's dtype."""
    return matmul_reference(x, qw).to(x.dtype)


@dataclass(frozen=True)
class PathOp:
    """One entry of the dispatch table: the op a path runs and where it can run.

    ``run(x, qw)`` returns y in x's dtype; ``max_m`` is the most rows it serves (None: any);
    ``kernel`` says it needs the Triton kernels (common.kernels_run_on); ``runs_on(device, bits)``,
    when given, narrows where it runs further; ``fuses_norm``: ``run(x, qw, norm=...)`` applies a
    RowNorm to x in its own input transform (the other paths get x normalised first);
    ``fuses_head_norm``: ``run(x, qw, head_norm=...)`` applies a HeadNorm to y in its output
    transform (the other paths' y goes through it after). ``launch``, when given, is ``run``
    without the argument checks ``escha.matmul`` has made by then (same arguments, same result):
    an eager decode call's host time is what its checks and launches cost.
    """

    run: Callable[..., torch.Tensor]
    max_m: int | None = None
    kernel: bool = True
    runs_on: Callable[[torch.device, int], bool] | None = None
    fuses_norm: bool = False  # run(x, qw, norm=RowNorm) applies the norm in its input transform
    fuses_head_norm: bool = False  # run(x, qw, head_norm=HeadNorm) applies it in its output transform
    launch: Callable[..., torch.Tensor] | None = None  # run on checked arguments

    def available(self, device: torch.device, bits: int, m: int, kernels: bool) -> bool:
        """Whether this op can run M rows of a K=bits weight on ``device``."""
        return ((kernels or not self.kernel) and (self.max_m is None or m <= self.max_m)
                and (self.runs_on is None or self.runs_on(device, bits)))


@functools.cache
def dispatch_table() -> dict[KernelPath, PathOp]:
    """The dispatch table: path -> op (built on first use, which imports the kernels)."""
    from .kernels import decode, dequant_bf16, dequant_core_bf16, dequant_core_fp8, dequant_fp8, prefill
    from .kernels.decode import MAX_DECODE_M
    from .kernels.decode_fp8 import decode_fp8, launch_checked as decode_fp8_checked
    from .kernels.decode_wgmma import decode_wgmma, launch_checked as decode_wgmma_checked, runs_on
    return {
        KernelPath.REFERENCE: PathOp(reference, kernel=False),
        KernelPath.DECODE: PathOp(decode, max_m=MAX_DECODE_M, fuses_norm=True, fuses_head_norm=True),
        KernelPath.DECODE_WGMMA: PathOp(decode_wgmma, runs_on=runs_on, fuses_norm=True, fuses_head_norm=True,
                                        launch=decode_wgmma_checked),
        KernelPath.PREFILL: PathOp(prefill, fuses_norm=True),
        KernelPath.DEQUANT_FP8: PathOp(dequant_fp8, fuses_norm=True),
        KernelPath.DEQUANT_CORE_FP8: PathOp(dequant_core_fp8, fuses_norm=True),
        KernelPath.DEQUANT_BF16: PathOp(dequant_bf16, fuses_norm=True),
        KernelPath.DEQUANT_CORE_BF16: PathOp(dequant_core_bf16, fuses_norm=True),
        KernelPath.DECODE_FP8: PathOp(decode_fp8, runs_on=runs_on, fuses_norm=True, fuses_head_norm=True,
                                      launch=decode_fp8_checked),
    }


def _kernels_run_on(device: torch.device) -> bool:
    return _kernels_common().kernels_run_on(device)


@functools.cache
def _kernels_common():
    """escha.kernels.common, imported on first use (an import statement costs every call its time)."""
    from .kernels import common
    return common


@dataclass(frozen=True)
class DispatchRule:
    """Thresholds that pick a path for the fp8 precision from M (rows of x) and K (in_features).

    M <= decode_max_m: a decode kernel (``resolve_path`` picks the register-operand or the
    portable one; past the portable kernel's 64 tokens, where the register-operand kernel cannot
    run, a dequantize-once path). decode_max_m < M < dequant_min_m: fused prefill kernel.
    dequant_min_m <= M <= fp8_decode_max_m: the fp8 decode GEMM (decode-fp8) where it runs (Hopper,
    K = 2 or 3), else as above it. Above: dequantize once + fp8 library GEMM, in one of two forms (``dequant_path``):
    the plain core and a pass over the output (dequant-core-fp8) up to ``core_m_per_kblock``
    tokens per 128 input features, the core with Hn folded in (dequant-fp8) above. The plain form
    saves a 128x128 product per weight block (work proportional to N*K) and pays a read and a write
    of the [M, N] output (proportional to M*N), so where one overtakes the other is proportional
    to K. The bf16 precision takes the same two forms at bf16 (dequant-core-bf16, dequant-bf16)
    at every M, with the same threshold: benchmarks/results/prefill_h200_v7 measured the plain
    form 11-23% faster at 128-512 tokens, level with the folded form at gate_up 2048 (40 blocks,
    51 rows a block) and down 8192 (68 blocks, 120 rows a block). The defaults are the fit of
    benchmarks/fit_dispatch.py on the H200's dense sweep (benchmarks/results/sweep_h200_v3/
    fit_dispatch.md: every escha path at 20 M from 1 to 8192 on both seed shapes): the
    register-operand decode kernel was fastest up to 128 tokens, the plain-core form from 192 to
    2048 and the folded form from 4096; since then the fp8 decode GEMM, its activations by TMA and
    its words straight into registers, beats the register-operand kernel from 96 tokens (13-22%
    on three shapes at 96 and 128, K = 2 and 3) and loses to it at 32-64 (3-14%), so
    decode_max_m is 64 (benchmarks/results/decode_fp8/h200_fdcb84e, docs/KERNELS.md "Decode on
    the fp8 tensor cores"); the fused prefill kernel never was the fastest, so it
    stays selectable only (path="prefill", or a rule with a larger dequant_min_m). Any
    core_m_per_kblock from 31 to 51 chose the faster form at every point of the sweep before
    (sweep_h200_v2), and the same forms won at every point of this one; 48 (from
    benchmarks/results/prefill_h200_v6, where gate_up at 2048 = 51 rows a block was level). The
    fourth sweep (benchmarks/results/sweep_h200_v4/ and sweep_h200_v4_families/: four shapes of
    three model families, decode-fp8 among the paths) fits these thresholds on the two other
    families, and on the seed shapes departs from them only at down's 512 tokens; the rule loses
    at most 4.5% to the fastest path there but on two down projections at 384-768 tokens
    (docs/KERNELS.md, "Dispatcher"). The fifth (sweep_h200_v5, the same four shapes, with the
    plain core's own GEMM from 1024 tokens, kernels/core_gemm.py) fits the same rule: no
    core_m_per_kblock loses less than its 3.8% between the two forms, and the rule in force
    lost at most 3.3% against the fastest path at every point.
    """

    decode_max_m: int = 64
    dequant_min_m: int = 65
    core_m_per_kblock: int = 48
    #: decode_fp8 from dequant_min_m to here: its blocks of up to 256 tokens decode each weight
    #: once, and it was 27-36% faster than the plain-core form at 192 and 256 tokens on three
    #: shapes and 13-22% faster than the register-operand decode kernel at 96 and 128; from 384
    #: (two blocks, each weight decoded twice) it lost or drew on two of three
    #: (benchmarks/results/decode_fp8/h200_ad4f7ce, h200_fdcb84e, docs/KERNELS.md "Decode on the
    #: fp8 tensor cores").
    fp8_decode_max_m: int = 256

    def __post_init__(self) -> None:
        # The thresholds become ints of the custom op's schema; the ranges above must not overlap
        # (an fp8_decode_max_m below dequant_min_m leaves the fp8 decode range empty, which is allowed).
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"DispatchRule.{f.name} must be an int, got {type(v).__name__}")
            if v < 0:
                raise ValueError(f"DispatchRule.{f.name} must be non-negative, got {v}")
        if self.dequant_min_m <= self.decode_max_m:
            raise ValueError(f"DispatchRule.dequant_min_m must be greater than decode_max_m ({self.decode_max_m}), "
                             f"got {self.dequant_min_m}")

    def choose(self, m: int, precision: Precision | str = Precision.FP8, *, in_features: int) -> KernelPath:
        """The path for M rows of a weight with ``in_features`` inputs at this precision."""
        if _PRECISION_CODE[precision] == _PRECISION_CODE[Precision.BF16]:
            return self.dequant_path(m, in_features, Precision.BF16)
        if m <= self.decode_max_m:
            return KernelPath.DECODE
        if m < self.dequant_min_m:
            return KernelPath.PREFILL
        if m <= self.fp8_decode_max_m:
            return KernelPath.DECODE_FP8
        return self.dequant_path(m, in_features)

    def dequant_path(self, m: int, in_features: int, precision: Precision | str = Precision.FP8) -> KernelPath:
        """The dequantize-once form for M rows at this precision: the plain core up to
        core_m_per_kblock rows per 128-block of inputs, the core with Hn folded in above."""
        kblocks = -(-in_features // 128)
        plain = m <= self.core_m_per_kblock * kblocks
        if _PRECISION_CODE[precision] == _PRECISION_CODE[Precision.BF16]:
            return KernelPath.DEQUANT_CORE_BF16 if plain else KernelPath.DEQUANT_BF16
        return KernelPath.DEQUANT_CORE_FP8 if plain else KernelPath.DEQUANT_FP8


DEFAULT_RULE = DispatchRule()

# Ints for the custom op's schema. Dict lookups (not Enum construction) so that strings and
# members both work and torch.compile traces them as constants.
_PATHS = tuple(KernelPath)
_PATH_CODE: dict[object, int] = {**{p: i for i, p in enumerate(_PATHS)},
                                 **{p.value: i for i, p in enumerate(_PATHS)}}
_AUTO = -1
_PRECISIONS = tuple(Precision)
_PRECISION_CODE: dict[object, int] = {**{p: i for i, p in enumerate(_PRECISIONS)},
                                      **{p.value: i for i, p in enumerate(_PRECISIONS)}}


def check_inputs(x: object, qw: object) -> None:
    """Raise a TypeError/ValueError naming the problem if (x, qw) cannot be multiplied."""
    from .kernels import common
    common.check_operands(x, qw)


def _check_choice(path: object, precision: object, rule: object) -> None:
    """Raise a TypeError/ValueError naming the problem if (path, precision, rule) is not a choice
    escha.matmul accepts."""
    if path is not None and not isinstance(path, str):  # KernelPath members are strings too
        raise TypeError(f"path must be None, a KernelPath or one of {[p.value for p in _PATHS]}, "
                        f"got {type(path).__name__}")
    if path is not None and path not in _PATH_CODE:
        raise ValueError(f"unknown path {path!r}; choose one of {[p.value for p in _PATHS]}")
    if not isinstance(precision, str):
        raise TypeError(f"precision must be a Precision or one of {[p.value for p in _PRECISIONS]}, "
                        f"got {type(precision).__name__}")
    if precision not in _PRECISION_CODE:
        raise ValueError(f"unknown precision {precision!r}; choose one of {[p.value for p in _PRECISIONS]}")
    if rule is not None and not isinstance(rule, DispatchRule):
        raise TypeError(f"rule must be an escha.DispatchRule or None, got {type(rule).__name__}")


def _check_rows(qw: object, M: object) -> None:
    """Raise a TypeError/ValueError unless qw is a QuantizedWeight and M a positive int."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if isinstance(M, bool) or not isinstance(M, int):
        raise TypeError(f"M (rows of x) must be an int, got {type(M).__name__}")
    if M < 1:
        raise ValueError(f"M (rows of x) must be positive, got {M}")


def available_paths(qw: QuantizedWeight, M: int) -> list[KernelPath]:
    """Every path that can run for this weight at M rows on its device (reference always)."""
    _check_rows(qw, M)
    kernels = _kernels_run_on(qw.device)
    return [p for p, op in dispatch_table().items() if op.available(qw.device, qw.bits, M, kernels)]


def resolve_path(m: int, qw: QuantizedWeight, path: KernelPath | str | None = None,
                 precision: Precision | str = Precision.FP8, rule: DispatchRule | None = DEFAULT_RULE) -> KernelPath:
    """The path ``matmul(x, qw, ...)`` runs for M rows of x (what it does, without running it).

    The rule's decode range runs the register-operand kernel where it can (Hopper, K = 2 or 3:
    since the transforms moved into registers it measured faster than the portable kernel at 11
    of 12 points up to 16 tokens on four shapes, docs/KERNELS.md); elsewhere the portable kernel,
    up to its 64 tokens; above those, dequantize-once, but from dequant_min_m to
    fp8_decode_max_m the fp8 decode GEMM where it can (Hopper, K = 2 or 3). A path asked for by
    name runs as asked. ``rule=None`` means DEFAULT_RULE, as in matmul.
    """
    _check_rows(qw, m)
    _check_choice(path, precision, rule)
    return _resolve_path(m, qw, path, precision, DEFAULT_RULE if rule is None else rule)


def _resolve_path(m: int, qw: QuantizedWeight, path: KernelPath | str | None, precision: Precision | str,
                  rule: DispatchRule) -> KernelPath:
    """resolve_path on checked arguments."""
    device = qw.device
    return _resolve(m, qw.shape, qw.bits, qw.codebook_id, device, _kernels_run_on(device),
                    None if path is None else _PATH_CODE[path], _PRECISION_CODE[precision], rule)


@functools.lru_cache(maxsize=4096)
def _resolve(m: int, shape: tuple[int, int], bits: int, codebook_id: int, device: torch.device, kernels: bool,
             path: int | None, precision: int, rule: DispatchRule) -> KernelPath:
    """resolve_path for a weight's shape, bits, codebook and device (``kernels``: whether kernels
    run there): kept per argument set, since every call asks for it (an eager decode step makes
    160 calls)."""
    if not kernels or codebook_id != 0:
        # The kernels implement the 3INST codebook (id 0) only; others decode by reference.
        return KernelPath.REFERENCE
    if path is not None:
        return _PATHS[path]
    chosen = rule.choose(m, _PRECISIONS[precision], in_features=shape[1])
    if chosen == KernelPath.DECODE_FP8:
        if dispatch_table()[KernelPath.DECODE_FP8].available(device, bits, m, True):
            return chosen
        return rule.dequant_path(m, shape[1])
    if chosen != KernelPath.DECODE:
        return chosen
    if dispatch_table()[KernelPath.DECODE_WGMMA].available(device, bits, m, True):
        return KernelPath.DECODE_WGMMA
    if dispatch_table()[KernelPath.DECODE].available(device, bits, m, True):
        return KernelPath.DECODE
    return rule.dequant_path(m, shape[1])  # past the portable kernel's range


# The custom op's schema: x, the weight's stored tensors in declaration order, then ints.
_INT_ARGS = ("out_features", "in_features", "bits", "codebook_id", "path", "precision",
             "decode_max_m", "dequant_min_m", "core_m_per_kblock", "fp8_decode_max_m")
# Then, optionally, the weight and eps of a RowNorm applied to x first, and the row weights,
# block flags and eps of a HeadNorm applied to y's heads.
_SCHEMA = ("(Tensor x, " + ", ".join(f"Tensor {n}" for n in TENSOR_NAMES) + ", "
           + ", ".join(f"int {n}" for n in _INT_ARGS) + ", Tensor? norm_weight=None, float norm_eps=0.0, "
           "Tensor? head_weight=None, Tensor? head_blocks=None, float head_eps=0.0) -> Tensor")
_N_FIXED = len(TENSOR_NAMES) + len(_INT_ARGS)
_OPTIONAL = (None, 0.0, None, None, 0.0)  # the defaults of the arguments after the fixed ones


def _out_dtype(x: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.dtype:
    """y's dtype: x's, or the normalised x's (RowNorm.apply promotes to its weight's dtype)."""
    return x.dtype if norm_weight is None else torch.promote_types(x.dtype, norm_weight.dtype)


def _product(x: torch.Tensor, qw: QuantizedWeight, path: KernelPath | str | None, precision: Precision | str,
             rule: DispatchRule, norm: RowNorm | None, head: HeadNorm | None) -> torch.Tensor:
    """The work of escha.matmul on checked arguments: pick the path, run it, apply what it did not fuse."""
    x2d = x if x.dim() == 2 else x.reshape(-1, qw.in_features)
    m = x2d.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], qw.out_features), dtype=_out_dtype(x, None if norm is None else norm.weight))
    op = dispatch_table()[_resolve_path(m, qw, path, precision, rule)]
    kwargs = {}
    if norm is not None:
        if op.fuses_norm and norm.fusable(x2d):
            kwargs["norm"] = norm
        else:
            x2d = norm.apply(x2d)
    if head is not None and op.fuses_head_norm and head.fusable(x2d):  # y has x2d's dtype and device
        kwargs["head_norm"], head = head, None
    # A path the rule chose can run here (dispatch_table's ``available``) on operands matmul has
    # checked: its launch skips the op's own checks. A path asked for by name runs with them.
    run = (op.launch or op.run) if path is None else op.run
    y = run(x2d, qw, **kwargs)
    if head is not None:
        y = head.apply(y)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], qw.out_features)


def _check_call(x: object, qw: object, norm: object, head_norm: object) -> None:
    """matmul's checks of its operands and norms (the paths' launches check none of them)."""
    check_inputs(x, qw)
    if norm is not None and not isinstance(norm, RowNorm):
        raise TypeError(f"norm must be an escha.RowNorm, got {type(norm).__name__}")
    if norm is not None and (norm.weight.shape[0] != qw.in_features or norm.weight.device != x.device):
        raise ValueError(f"the norm's weight must be [{qw.in_features}] on {x.device}, got "
                         f"{list(norm.weight.shape)} on {norm.weight.device}")
    if head_norm is not None and not isinstance(head_norm, HeadNorm):
        raise TypeError(f"head_norm must be an escha.norm.HeadNorm, got {type(head_norm).__name__}")
    if head_norm is not None and head_norm.weight.shape[0] != qw.padded_shape[0]:  # HeadNorm checks its flags
        np_ = qw.padded_shape[0]
        raise ValueError(f"the head norm must have [{np_}] row weights and [{np_ // HEAD}] block flags, got "
                         f"{list(head_norm.weight.shape)} and {list(head_norm.blocks.shape)}")


def _matmul_impl(x: torch.Tensor, *args) -> torch.Tensor:
    """escha::matmul. path = -1 picks by rule at run time (so one compiled graph serves every M)."""
    tensors, ints = args[:len(TENSOR_NAMES)], args[len(TENSOR_NAMES):_N_FIXED]
    rest = tuple(args[_N_FIXED:])
    norm_weight, norm_eps, head_weight, head_blocks, head_eps = rest + _OPTIONAL[len(rest):]
    out_features, in_features, bits, codebook_id, path, precision, *limits = ints
    rule = DispatchRule(*limits)
    qw = QuantizedWeight.trusted(tensors, (out_features, in_features), bits, codebook_id)
    norm = None if norm_weight is None else RowNorm(norm_weight, norm_eps)
    head = None if head_weight is None else HeadNorm(head_weight, head_blocks, head_eps)
    _check_call(x, qw, norm, head)  # the op may be called by name, without matmul's checks
    return _product(x, qw, None if path == _AUTO else _PATHS[path], _PRECISIONS[precision], rule, norm, head)


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor | None, grad: bool) -> bool:
    """A tensor no subclass, tracer or autograd needs to see (or no tensor); ``grad``:
    ``torch.is_grad_enabled()``."""
    return t is None or (type(t) in _PLAIN_TYPES and not (grad and t.requires_grad))


def _direct(x: torch.Tensor, qw: QuantizedWeight, norm: RowNorm | None, head_norm: HeadNorm | None) -> bool:
    """Whether a call may run its implementation without the custom op's dispatch, with the same
    result: an eager call (no compiler, TorchScript trace, functorch transform, dispatch or
    function mode, no profiler recording ops) on plain tensors that need no gradient. The dispatch
    costs tens of µs a call on the host, as much as the kernels' launches at a few tokens
    (docs/KERNELS.md, "Host time of a call")."""
    if (torch.compiler.is_compiling() or torch.autograd._profiler_enabled()
            or torch._C._is_torch_function_mode_enabled() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active()  # vmap's tensors look plain
            or torch.jit.is_tracing()):  # a trace records ops, not kernel launches
        return False
    grad = torch.is_grad_enabled()
    return (_plain(x, grad) and all(_plain(getattr(qw, name), grad) for name in TENSOR_NAMES)
            and (norm is None or _plain(norm.weight, grad)) and (head_norm is None or _plain(head_norm.weight, grad)))


def _matmul_fake(x: torch.Tensor, *args) -> torch.Tensor:
    out_features = args[len(TENSOR_NAMES)]
    norm_weight = (tuple(args[_N_FIXED:]) + _OPTIONAL)[0]
    return x.new_empty((*x.shape[:-1], out_features), dtype=_out_dtype(x, norm_weight))


def _decode_core_impl(*args) -> torch.Tensor:
    """escha::decode_core: the core T, fp16 [Np, Kp], of the weight's stored tensors and ints; by
    the dequant kernel on a GPU (bit-exact), by the reference decoder elsewhere."""
    tensors, (out_features, in_features, bits, codebook_id) = args[:len(TENSOR_NAMES)], args[len(TENSOR_NAMES):]
    qw = QuantizedWeight.trusted(tensors, (out_features, in_features), bits, codebook_id)
    if qw.device.type == "cuda" and codebook_id == 0:
        from .kernels.dequant import dequantize_core
        return dequantize_core(qw, torch.float16)[0]
    from .format.codec import decode_trellis
    return decode_trellis(qw)


def _decode_core_fake(*args) -> torch.Tensor:
    out_features, in_features = args[len(TENSOR_NAMES):len(TENSOR_NAMES) + 2]
    return args[0].new_empty((padded(out_features), padded(in_features)), dtype=torch.float16)


# matmul's backward multiplies by T: an op, since a compiled backward cannot trace the decoders.
_decode_core_op = torch.library.custom_op(
    "escha::decode_core", _decode_core_impl, mutates_args=(),
    schema="(" + ", ".join(f"Tensor {n}" for n in TENSOR_NAMES)
           + ", int out_features, int in_features, int bits, int codebook_id) -> Tensor")
_decode_core_op.register_fake(_decode_core_fake)

# The backward multiplies in the transform domain, W_hat = diag(g c su) Hn T Hk diag(sv) / 128
# (docs/FORMAT.md section 5), and decodes T one run of whole 128-row blocks at a time, so it never
# holds W_hat and its temporaries stay a few runs of T whatever the weight's size: on the CPU, for
# a 4096 x 4096 weight at 8 tokens, 0.35 GiB at peak and 1.4 s against 2.1 GiB and 2.9 s for the
# whole W_hat by the reference decoder (benchmarks/bench_backward.py, results/backward_cpu/). On
# a GPU T comes from the dequant kernel: on an H100, gate_up (17408 x 5120) at 16 tokens, 6.5 MiB
# above the inputs at peak and 32 ms (host wall clock), against 11.1 GiB and 38 ms for the whole
# W_hat (results/h100_9ff1615/backward/). Those 32 ms were 136 runs of one 128-row block, about
# 0.24 ms each, where the dequant kernel decodes all 136 blocks in under 0.1 ms (docs/KERNELS.md):
# mostly host work, by that arithmetic. So on a GPU a run is 2^24 weights (gate_up in 6 runs; T
# in fp16 and its fp32 copy about 100 MB at most), fewer launches for the same GPU work. Timed on
# an H100 (results/h100_5550e90/backward/, 16 tokens): gate_up 3.0 ms and 97 MiB at 2^24, against
# 30.8 ms (2^20), 6.3 ms (2^22) and 1.4 ms at 387 MiB (2^26); 4096 x 4096 1.9 ms at 97 MiB (5.6 ms
# at 2^20). 2^26 halves the time again for four times the memory: 2^24 stays.
BACKWARD_RUN_WEIGHTS = {"cpu": 1 << 20, "cuda": 1 << 24}  # padded weights a decoded run at most, by device


def _row_runs(qw: QuantizedWeight, run_weights: int | None = None):
    """(first padded row, end padded row, escha::decode_core's arguments) for each run of whole
    128-row blocks (at most ``run_weights`` padded weights a run, one block at least; None: the
    device's BACKWARD_RUN_WEIGHTS); a run is a valid weight of its own (escha.format.shard), so its
    T is those rows of the whole weight's T."""
    from .format.shard import ShardPlan, take
    np_, kp = qw.padded_shape
    if run_weights is None:
        run_weights = BACKWARD_RUN_WEIGHTS.get(qw.device.type, BACKWARD_RUN_WEIGHTS["cpu"])
    per = max(1, run_weights // (HAD_BLOCK * kp))
    for a in range(0, np_ // HAD_BLOCK, per):
        b = min(np_ // HAD_BLOCK, a + per)
        rows = (a * HAD_BLOCK, min(b * HAD_BLOCK, qw.out_features))
        plan = ShardPlan(0, ((a, b),), (rows,))
        run = [take(spec, plan, getattr(qw, spec.name).__getitem__) for spec in QuantizedWeight.TENSORS]
        yield a * HAD_BLOCK, b * HAD_BLOCK, (*run, rows[1] - rows[0], qw.in_features, qw.bits, qw.codebook_id)


def _hadamard_pm1(x: torch.Tensor) -> torch.Tensor:
    """x [M, n] float32 times blockdiag(H, H, ...) of the exact +-1 128-matrix, built by device ops
    (a backward may be traced, and a trace cannot take escha.format.hadamard's cached matrix)."""
    from .format.hadamard import sylvester_pm1
    h = sylvester_pm1(HAD_BLOCK, x.device, torch.float32)
    return (x.unflatten(-1, (-1, HAD_BLOCK)) @ h).flatten(-2)


def _times_w(g: torch.Tensor, qw: QuantizedWeight, run_weights: int | None = None) -> torch.Tensor:
    """g [M, out] -> float32 [M, in]: g @ W_hat = ((g diag(g c su)) Hn) T Hk diag(sv) / 128."""
    from .format.codec import row_scale
    np_, kp = qw.padded_shape
    gs = torch.nn.functional.pad(g.to(torch.float32) * row_scale(qw)[:qw.out_features], (0, np_ - qw.out_features))
    gh = _hadamard_pm1(gs)
    z = gh.new_zeros((gh.shape[0], kp))
    for r0, r1, args in _row_runs(qw, run_weights):
        z.addmm_(gh[:, r0:r1], torch.ops.escha.decode_core(*args).to(torch.float32))
    return (_hadamard_pm1(z) * (qw.sv.float() / HAD_BLOCK))[:, :qw.in_features]


def _times_wt(h: torch.Tensor, qw: QuantizedWeight, run_weights: int | None = None) -> torch.Tensor:
    """h [M, in] -> float32 [M, out]: h @ W_hat^T = ((h diag(sv) Hk) T^T Hn / 128) diag(g c su)."""
    from .format.codec import row_scale
    kp = qw.padded_shape[1]
    hh = _hadamard_pm1(torch.nn.functional.pad(h.to(torch.float32), (0, kp - qw.in_features)) * qw.sv.float())
    z = torch.cat([hh @ torch.ops.escha.decode_core(*args).to(torch.float32).T
                   for _, _, args in _row_runs(qw, run_weights)], dim=1)
    return (_hadamard_pm1(z) * (row_scale(qw) / HAD_BLOCK))[:, :qw.out_features]


def _matmul_setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    """Keep what escha::matmul's backward needs: the weight's tensors and ints, the norms, and x with norms."""
    x, args = inputs[0], inputs[1:]
    norm_weight, norm_eps, head_weight, head_blocks, head_eps = (tuple(args[_N_FIXED:]) + _OPTIONAL)[:len(_OPTIONAL)]
    ctx.ints, ctx.eps, ctx.x_dtype = args[len(TENSOR_NAMES):_N_FIXED], (norm_eps, head_eps), x.dtype
    # x is needed only to differentiate through the norms; without them the gradient is linear in grad_y.
    normed = norm_weight is not None or head_weight is not None
    ctx.save_for_backward(x if normed else None, *args[:len(TENSOR_NAMES)], norm_weight, head_weight, head_blocks)


def _matmul_backward(ctx, grad_y: torch.Tensor) -> tuple:
    """Gradients of escha::matmul: x's (grad_y @ W_hat) and the norms' weights'; the quantized
    weight is frozen (None for its tensors), as are the ints, flags and eps."""
    x, *saved = ctx.saved_tensors
    tensors, (norm_weight, head_weight, head_blocks) = saved[:len(TENSOR_NAMES)], saved[len(TENSOR_NAMES):]
    out_features, in_features = ctx.ints[:2]
    grads: list[torch.Tensor | None] = [None] * (1 + _N_FIXED + len(_OPTIONAL))
    i_norm, i_head = 1 + _N_FIXED, 1 + _N_FIXED + 2  # positions of norm_weight, head_weight
    wanted = [i for i in (0, i_norm, i_head) if i < len(ctx.needs_input_grad) and ctx.needs_input_grad[i]]
    if not wanted:  # no input asks for a gradient: the weight is not decoded
        return tuple(grads)
    qw = QuantizedWeight.trusted(tensors, (out_features, in_features), *ctx.ints[2:4])
    if norm_weight is None and head_weight is None:  # then only x can want one
        g = _times_w(grad_y.reshape(-1, out_features), qw)
        grads[0] = g.to(ctx.x_dtype).reshape(*grad_y.shape[:-1], in_features)
        return tuple(grads)
    # With norms: differentiate the function the reference path computes (norm, product at its
    # output's dtype, head norm) in PyTorch, the product by hand (T decoded run by run, never kept
    # for autograd); the kernels' fused forms match it within tolerance.
    with torch.enable_grad():
        leaves = {0: x.detach(), i_norm: None if norm_weight is None else norm_weight.detach(),
                  i_head: None if head_weight is None else head_weight.detach()}
        for i in wanted:
            leaves[i].requires_grad_(True)
        h = leaves[0] if norm_weight is None else RowNorm(leaves[i_norm], ctx.eps[0]).apply(leaves[0])
        h2d = h.reshape(-1, in_features)
        grad_z = grad_y.reshape(-1, out_features)
        if head_weight is not None:
            z = _times_wt(h2d.detach(), qw).to(h.dtype).requires_grad_(True)
            head_leaves = [z] + ([leaves[i_head]] if i_head in wanted else [])
            found = torch.autograd.grad(HeadNorm(leaves[i_head], head_blocks, ctx.eps[1]).apply(z), head_leaves,
                                        grad_z, allow_unused=True)
            grad_z = found[0]
            if i_head in wanted:
                grads[i_head] = found[1]
        h_wanted = [i for i in wanted if i != i_head]  # x's and the norm's: through h
        if h_wanted:
            grad_h = _times_w(grad_z, qw).to(h.dtype)
            found = torch.autograd.grad(h2d, [leaves[i] for i in h_wanted], grad_h, allow_unused=True)
            for i, g in zip(h_wanted, found):
                grads[i] = g
    return tuple(grads)


_matmul_op = torch.library.custom_op("escha::matmul", _matmul_impl, mutates_args=(), schema=_SCHEMA)
_matmul_op.register_fake(_matmul_fake)
_matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup_context)


def matmul(x: torch.Tensor, qw: QuantizedWeight, path: KernelPath | str | None = None, *,
           precision: Precision | str = Precision.FP8,
           rule: DispatchRule | None = None, norm: RowNorm | None = None,
           head_norm: HeadNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T, returned in x's dtype (with ``norm``: norm(x) @ W_hat^T,
    in norm(x)'s dtype).

    Args:
        x: fp16/bf16/fp32 activations on the weight's device.
        qw: the Escha W2 weight.
        path: force a path (a ``KernelPath`` or its name); None lets ``rule`` choose by M.
        precision: ``"fp8"`` (default; fp8 e4m3 GEMM operands) or ``"bf16"`` (accuracy-first:
            dequantize to bf16 and multiply in bf16). Ignored when ``path`` is given.
        rule: the dispatch thresholds; None means DEFAULT_RULE.
        norm: an ``escha.RowNorm`` (the RMSNorm before the layer) to apply to x first: every
            kernel path does it in its input transform or activation pass when the norm's weight
            has x's dtype (``RowNorm.fusable``), the reference path and other weights before it
            (``RowNorm.apply``).
        head_norm: an ``escha.norm.HeadNorm`` (the per-head RMSNorm after the layer, e.g. Qwen3's
            q_norm) to apply to y's flagged 128-row heads: the decode kernels do it in their output
            transform, the other paths after it (``HeadNorm.apply``).

    NaN or Inf in a row of x turn that row of y non-finite, as they would through torch.matmul.

    Eager calls of the decode paths on Hopper GPUs (up to 256 tokens) run their three kernels
    as one CUDA graph from a weight and token count's second call on a stream, with the same
    bits as their launches. A stream that does so keeps one workspace buffer, sized by its
    largest such call (64 MiB for a 17408 x 5120 weight at 256 tokens). A weight keeps at most
    ``kernels.common.MAX_GRAPHS`` graphs per path and stream (docs/KERNELS.md, "Host time of a call").

    Gradient: with respect to x only (and to the norms' weights, where they require it); the
    quantized weight is frozen and gets none. grad_x = grad_y @ W_hat (W_hat = dequantize(qw),
    fp32 math, in x's dtype), through ``RowNorm.apply`` and ``HeadNorm.apply`` when the norms are
    given: the gradient of the function every path computes, whichever path ran the forward.
    """
    _check_call(x, qw, norm, head_norm)
    _check_choice(path, precision, rule)
    r = DEFAULT_RULE if rule is None else rule
    if _direct(x, qw, norm, head_norm):
        return _product(x, qw, path, precision, r, norm, head_norm)
    code = _AUTO if path is None else _PATH_CODE[path]
    ints = (qw.out_features, qw.in_features, qw.bits, qw.codebook_id, code, _PRECISION_CODE[precision],
            r.decode_max_m, r.dequant_min_m, r.core_m_per_kblock, r.fp8_decode_max_m)
    norms = (None, 0.0) if norm is None else (norm.weight, float(norm.eps))
    heads = (None, None, 0.0) if head_norm is None else (head_norm.weight, head_norm.blocks, float(head_norm.eps))
    return torch.ops.escha.matmul(x, *qw.tensors().values(), *ints, *norms, *heads)
