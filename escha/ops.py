"""escha.matmul: y = x @ W_hat^T for an Escha W2 weight, dispatched to a kernel path.

Paths (``Path``):
    reference     plain PyTorch through the transform domain (escha.format), fp32 math.
    decode        the decode GEMM (escha.kernels.decode), for few rows (M <= 64).
    prefill       the fused kernel: trellis decoded inside an fp8 tensor-core GEMM.
    dequant-fp8   dequantize once to an fp8 scratch, then torch._scaled_mm (row-wise scales).
    dequant-bf16  dequantize once to a bf16 scratch, then a bf16 matmul: the accuracy-first path.

Which path runs is a pure function of (M, precision, DispatchRule): ``choose_path``. The rule's
numbers come from the measured crossovers in benchmarks/results/prefill.md. A caller overrides it
per call (``rule=``, ``path=``, ``precision=``); a layer that wants another precision passes its
own argument on every call. There is deliberately no global or context-managed setting: an
argument is thread-safe without locks, visible to torch.compile as a constant, and cannot leak
from one layer or request into another.

Where the kernels run: on CUDA tensors always. On CPU only when the Triton kernels were created in
interpreter mode (TRITON_INTERPRET=1 set before escha is imported); otherwise every CPU call takes
the reference path, whatever path was asked for, since compiled Triton kernels cannot run there.

The entry point is the custom op ``escha::matmul`` (tensors of the weight plus ints), with a fake
implementation, so it works under torch.compile(fullgraph=True) and inside CUDA-graph capture:
nothing in it synchronizes with the host or copies from host memory.
"""
from __future__ import annotations

import enum
import importlib
from dataclasses import dataclass

import torch

from .format.codec import matmul_reference
from .format.qweight import QuantizedWeight

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Path(str, enum.Enum):
    """A way of computing escha.matmul; the value is the name benchmarks and logs use."""

    REFERENCE = "reference"
    DECODE = "decode"
    PREFILL = "prefill"
    DEQUANT_FP8 = "dequant-fp8"
    DEQUANT_BF16 = "dequant-bf16"

    def __str__(self) -> str:
        return self.value


class Precision(str, enum.Enum):
    """Operand precision of the GEMM: fp8 e4m3 (fast) or bf16 (accuracy-first)."""

    FP8 = "fp8"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class DispatchRule:
    """Thresholds on M (rows of x) that pick a path for the fp8 precision.

    M <= decode_max_m: decode kernel. decode_max_m < M < dequant_min_m: fused prefill kernel.
    M >= dequant_min_m: dequantize once + fp8 library GEMM. The bf16 precision always takes the
    dequant-bf16 path. Defaults from the H200 measurements (benchmarks/results/prefill.md): at
    both Qwen3-14B TP=2 shapes and every measured M (512, 2048, 8192) dequantize-once beat the
    fused kernel by 1.25x to 3.7x, so by default every M above the decode range takes it; the
    fused kernel stays selectable (path="prefill", or a rule with a larger dequant_min_m).
    """

    decode_max_m: int = 64
    dequant_min_m: int = 65

    def choose(self, m: int, precision: Precision | str = Precision.FP8) -> Path:
        """The path for M rows at this precision."""
        if _PRECISION_CODE[precision] == _PRECISION_CODE[Precision.BF16]:
            return Path.DEQUANT_BF16
        if m <= self.decode_max_m:
            return Path.DECODE
        if m < self.dequant_min_m:
            return Path.PREFILL
        return Path.DEQUANT_FP8


DEFAULT_RULE = DispatchRule()

# Ints for the custom op's schema. Dict lookups (not Enum construction) so that strings and
# members both work and torch.compile traces them as constants.
_PATHS = tuple(Path)
_PATH_CODE: dict[object, int] = {**{p: i for i, p in enumerate(_PATHS)},
                                 **{p.value: i for i, p in enumerate(_PATHS)}}
_AUTO = -1
_PRECISIONS = tuple(Precision)
_PRECISION_CODE: dict[object, int] = {**{p: i for i, p in enumerate(_PRECISIONS)},
                                      **{p.value: i for i, p in enumerate(_PRECISIONS)}}


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


def kernels_enabled(device: torch.device) -> bool:
    """True where the Triton kernels can run: CUDA, or CPU when Triton runs in interpreter mode."""
    if device.type == "cuda":
        return True
    if device.type != "cpu":
        return False
    from .kernels import prefill  # imported lazily: escha imports without triton's GPU backend
    return type(prefill.prefill_kernel).__name__ == "InterpretedFunction"


def _decode_module():
    """escha.kernels.decode, or None where it is not available."""
    try:
        return importlib.import_module(".kernels.decode", __package__)
    except ImportError:
        return None


def available_paths(qw: QuantizedWeight, M: int) -> list[Path]:
    """Every path that can run for this weight at M rows on its device (reference always)."""
    paths = [Path.REFERENCE]
    if kernels_enabled(qw.device):
        if M <= DEFAULT_RULE.decode_max_m and _decode_module() is not None:
            paths.append(Path.DECODE)
        paths += [Path.PREFILL, Path.DEQUANT_FP8, Path.DEQUANT_BF16]
    return paths


def _weight_view(trellis, su, sv, scale, gscale, shape, bits, codebook_id) -> QuantizedWeight:
    """A QuantizedWeight over existing tensors without re-validating them.

    Validation reads values back to the host (a synchronization, illegal in CUDA-graph capture);
    the tensors came from a QuantizedWeight that was validated when it was built.
    """
    qw = object.__new__(QuantizedWeight)
    qw.trellis, qw.su, qw.sv, qw.scale, qw.gscale = trellis, su, sv, scale, gscale
    qw.shape, qw.bits, qw.codebook_id = tuple(shape), bits, codebook_id
    qw.had_block = 128
    return qw


def _run_path(path: Path, x2d: torch.Tensor, trellis, su, sv, scale, gscale, out_features: int,
              in_features: int, bits: int, codebook_id: int) -> torch.Tensor:
    if path == Path.REFERENCE:
        qw = _weight_view(trellis, su, sv, scale, gscale, (out_features, in_features), bits, codebook_id)
        return matmul_reference(x2d, qw).to(x2d.dtype)
    if path == Path.DECODE:
        qw = _weight_view(trellis, su, sv, scale, gscale, (out_features, in_features), bits, codebook_id)
        return _decode_module().decode_matmul(x2d, qw).to(x2d.dtype)
    from .kernels.actquant import actquant
    from .kernels.dequant_once import dequant_once_matmul
    from .kernels.prefill import prefill_matmul_q
    if path == Path.PREFILL:
        xq, sx = actquant(x2d, sv, fp8=True)
        return prefill_matmul_q(xq, sx, trellis, su, scale, gscale, out_features, bits, x2d.dtype)
    return dequant_once_matmul(x2d, trellis, su, sv, scale, gscale, out_features, bits,
                               fp8=path == Path.DEQUANT_FP8)


def resolve_path(m: int, device: torch.device, codebook_id: int, path: Path | str | None = None,
                 precision: Precision | str = Precision.FP8,
                 rule: DispatchRule = DEFAULT_RULE) -> Path:
    """The path a call with these arguments runs (what ``matmul`` does, without running it)."""
    if not kernels_enabled(device) or codebook_id != 0:
        # The kernels implement the 3INST codebook (id 0) only; others decode by reference.
        return Path.REFERENCE
    chosen = rule.choose(m, precision) if path is None else _PATHS[_PATH_CODE[path]]
    if chosen == Path.DECODE and _decode_module() is None:
        chosen = Path.PREFILL  # the fused kernel is correct at any M, only slower at small M
    return chosen


@torch.library.custom_op("escha::matmul", mutates_args=())
def _matmul_op(x: torch.Tensor, trellis: torch.Tensor, su: torch.Tensor, sv: torch.Tensor,
               scale: torch.Tensor, gscale: torch.Tensor, out_features: int, in_features: int,
               bits: int, codebook_id: int, path: int, precision: int, decode_max_m: int,
               dequant_min_m: int) -> torch.Tensor:
    """escha::matmul. path = -1 picks by rule at run time (so one compiled graph serves every M)."""
    x2d = x.reshape(-1, in_features)
    m = x2d.shape[0]
    if m == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    rule = DispatchRule(decode_max_m=decode_max_m, dequant_min_m=dequant_min_m)
    chosen = resolve_path(m, x.device, codebook_id, None if path == _AUTO else _PATHS[path],
                          _PRECISIONS[precision], rule)
    y = _run_path(chosen, x2d, trellis, su, sv, scale, gscale, out_features, in_features, bits,
                  codebook_id)
    return y.reshape(*x.shape[:-1], out_features)


@_matmul_op.register_fake
def _matmul_fake(x, trellis, su, sv, scale, gscale, out_features, in_features, bits, codebook_id,
                 path, precision, decode_max_m, dequant_min_m):
    return x.new_empty((*x.shape[:-1], out_features))


def matmul(x: torch.Tensor, qw: QuantizedWeight, path: Path | str | None = None, *,
           precision: Precision | str = Precision.FP8,
           rule: DispatchRule | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T, returned in x's dtype.

    Args:
        x: fp16/bf16/fp32 activations on the weight's device.
        qw: the Escha W2 weight.
        path: force a path (a ``Path`` or its name); None lets ``rule`` choose by M.
        precision: ``"fp8"`` (default; fp8 e4m3 GEMM operands) or ``"bf16"`` (accuracy-first:
            dequantize to bf16 and multiply in bf16). Ignored when ``path`` is given.
        rule: the dispatch thresholds; None means DEFAULT_RULE.

    NaN or Inf in a row of x turn that row of y non-finite, as they would through torch.matmul.
    """
    check_inputs(x, qw)
    r = DEFAULT_RULE if rule is None else rule
    if path is not None and path not in _PATH_CODE:
        raise ValueError(f"unknown path {path!r}; choose one of {[p.value for p in _PATHS]}")
    if precision not in _PRECISION_CODE:
        raise ValueError(f"unknown precision {precision!r}; choose one of {[p.value for p in _PRECISIONS]}")
    code = _AUTO if path is None else _PATH_CODE[path]
    return torch.ops.escha.matmul(x, qw.trellis, qw.su, qw.sv, qw.scale, qw.gscale,
                                  qw.out_features, qw.in_features, qw.bits, qw.codebook_id,
                                  code, _PRECISION_CODE[precision], r.decode_max_m, r.dequant_min_m)


# Integer ops per decoded weight, for the benchmark's codec-floor column: the 3INST value
# (mad, and, xor, two fp16 extractions, add) plus the 64-bit window extraction.
INT_OPS_PER_WEIGHT: dict[object, float] = {None: 11.0}
