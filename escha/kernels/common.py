"""What every kernel shares: where kernels run, the workspace cache, constants and rounding.

One place decides whether Triton runs in its CPU interpreter (``interpreted``), whether a device
may run inline PTX (``ptx_enabled``) and whether the kernels can run on a device at all
(``kernels_run_on``), and whether launches may overlap their predecessor's tail
(``dependent_launch_supported``, with ``wait_for_producer``/``release_dependents`` in the
kernels). A launch an op may repeat goes through ``prepare``, Triton's own launch that also returns
the compiled variant ready to launch again without Triton's per-call binding (``Prepared``).
Every op checks its operands with ``check_operands``/``check_codebook``,
rounds to narrower floats through ``round_to`` only, and builds the +-1 Hadamard matrix and the
output row scale through ``hadamard_pm1`` and ``row_scale_block``.
"""
from __future__ import annotations

import concurrent.futures
import functools
import inspect
import math
import threading
import weakref
from typing import Callable, TypeVar

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..format.hadamard import sylvester_pm1
from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK

T = TypeVar("T")


@triton.jit
def _probe():
    """A kernel that is never launched: its type tells how triton.jit wraps kernels here."""
    pass


# triton.jit reads TRITON_INTERPRET when a kernel is defined, so the probe, defined beside (and
# imported before) every kernel of this package, reports what every kernel is.
_INTERPRETED = type(_probe).__name__ == "InterpretedFunction"


def interpreted() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 before import)."""
    return _INTERPRETED


def ptx_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` may use inline PTX: NVIDIA GPUs with compiled Triton only."""
    return device.type == "cuda" and torch.version.cuda is not None and not interpreted()


def kernels_run_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: any GPU, or the CPU under the interpreter."""
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, kept per device: the decode path asks on every call."""
    return torch.cuda.get_device_capability(device)


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched as programmatic dependents (PDL: CUDA's
    programmatic stream serialization, sm_90 and later): a dependent starts while its
    predecessor finishes and waits for it (``wait_for_producer``) before touching its outputs."""
    return ptx_enabled(device) and device_capability(device)[0] >= 9


@triton.jit
def wait_for_producer(PDL: tl.constexpr):
    """With PDL: block until the previous kernel on the stream has completed and its writes are
    visible (griddepcontrol.wait). Everything before this line may read only immutable data
    (weights), and nothing before it may write."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """With PDL: let the next kernel on the stream launch now (griddepcontrol.launch_dependents;
    it still waits for this one's completion before reading what this one writes)."""
    if PDL:
        gdc_launch_dependents()


#: Activation dtypes every op takes (and returns).
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_operands(x: object, qw: object, op: str = "escha.matmul") -> None:
    """Raise a TypeError/ValueError naming the problem if ``op`` cannot multiply x by qw."""
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight, got {type(qw).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"x dtype {x.dtype} is not supported by {op}; use float16, bfloat16 or float32")
    if x.dim() < 1 or x.shape[-1] != qw.in_features:
        raise ValueError(f"x has inner dimension {x.shape[-1] if x.dim() else None}, "
                         f"but the weight expects {qw.in_features} (weight shape {qw.shape})")
    if x.device != qw.device:
        raise ValueError(f"x is on {x.device} but the weight is on {qw.device}; move one with .to()")


def output_tensor(x: torch.Tensor, m: int, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The [m, n] output of an op in x's dtype: ``out`` after checking it, or a new tensor."""
    if out is None:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with unit column stride, "
                         f"got {out.dtype} {list(out.shape)} stride {out.stride()}")
    return out


def check_codebook(qw: QuantizedWeight, op: str) -> None:
    """The kernels implement the 3INST codebook (id 0) only; refuse any other."""
    if qw.codebook_id != 0:
        raise ValueError(f"{op} implements the 3INST codebook only, got {qw.codebook.name}")


# -- Constants ----------------------------------------------------------------------------------
# Kernels may read only constexpr globals, so the constants they use are tl.constexpr; host code
# reads a number with ``.value``.

#: 1/sqrt(128): kernels multiply by the exact +-1 Hadamard matrix and apply this once, in fp32.
INV_SQRT_HAD = tl.constexpr(1.0 / math.sqrt(HAD_BLOCK))
#: sqrt(128): the largest growth of a row's max |x| through the normalized 128-point Hadamard.
SQRT_HAD = tl.constexpr(math.sqrt(HAD_BLOCK))
FP8_DTYPE = torch.float8_e4m3fn
#: Largest finite float8_e4m3fn value.
FP8_MAX = tl.constexpr(448.0)
#: Largest |3INST value| over all 65536 states (tests/test_codec_kernels.py checks it).
THREEINST_ABSMAX = 3.9727
#: Power of two that carries the core T into e4m3 (dequant core and the fused prefill kernel):
#: the largest with THREEINST_ABSMAX * 64 = 254.3 <= 448, so no value saturates, and small
#: weights stay in e4m3's normal range (smallest normal 2**-6). Exact, like any power of two.
CORE_FP8_SCALE = tl.constexpr(64.0)
#: log2 of the power of two that carries T into e4m3 in the fp8 decode GEMM (decode_fp8): its codec
#: forms 16 lo and 16 hi straight from the LCG word (3INST's xor constant 0x3B60 with 0x4B60: the
#: exponent field 12-15 becomes 16-19), so e4m3(16 T) costs no multiply; 16 T <= 63.6, and a
#: weight leaves e4m3's normal range only below |T| = 2**-10 (64 T: 2**-12), an error under 2**-14.
DECODE_FP8_SCALE_LOG2 = tl.constexpr(4)
#: Power of two that carries Hn_pm1 T into e4m3 (dequantize-once): |Hn_pm1 T| <= 128 * 4 = 512,
#: so halving keeps every value within 448 for any trellis bits.
HN_FP8_SCALE = tl.constexpr(0.5)

_INTERPRETED_C = tl.constexpr(_INTERPRETED)
TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of a tensor-core product of values exact in ``dtype``.

    The interpreter's bf16 arithmetic is unreliable under numpy 2 (a bf16 tl.dot returned
    garbage), so interpreted runs use fp32, which holds every fp16/bf16 value exactly.
    """
    return tl.float32 if interpreted() else TL_DTYPES[dtype]


# -- Launching ------------------------------------------------------------------------------
# An eager escha.matmul call is host-bound: Triton's launch (``kernel[grid](...)``) binds and
# specializes every argument on every call, and the decode path's own Python adds as much
# (benchmarks/results/host_h200_before/, benchmarks/results/host_h200/). ``prepare`` launches
# through Triton and returns a ``Prepared``: the compiled variant with every argument in parameter
# order, which an op that keeps a plan per (weight, shape of x, settings) launches again
# directly, changing only its per-call tensors (decode_wgmma.launch_checked).
_SIGNATURES: dict[object, tuple] = {}
_NO_DEFAULT = object()


def _signature(kernel) -> tuple[tuple[str, object], ...]:
    """(name, default) for each parameter of a JIT kernel, in order (interpreted ones too)."""
    sig = _SIGNATURES.get(kernel)
    if sig is None:
        params = kernel.params if hasattr(kernel, "params") else inspect.signature(kernel.fn).parameters.values()
        sig = tuple((p.name, _NO_DEFAULT if p.default is inspect.Parameter.empty else p.default)
                    for p in params)
        _SIGNATURES[kernel] = sig
    return sig


class Prepared:
    """A compiled kernel variant, its grid and its arguments in parameter order (constexprs
    included): ``run(*values)`` launches it again with the arguments at ``slots`` replaced.

    The caller owns the promise that the replaced arguments specialize as the first ones did
    (same dtypes, 16-byte alignment, and for ints the same value class): ops key their plans on
    everything else (decode_wgmma.launch_checked). The arguments at ``weak`` are held by weak reference:
    a plan kept per weight (``weight_plans``) must not keep alive the tensor its weight's plans
    are dropped with.
    """

    __slots__ = ("compiled", "grid", "values", "slots", "weak")

    def __init__(self, compiled, grid: tuple[int, ...], values: list, slots: tuple[int, ...],
                 weak: tuple[int, ...] = ()) -> None:
        # Holds no per-call tensor, and the weak ones by reference only.
        self.values = tuple(None if i in slots else weakref.ref(v) if i in weak else v for i, v in enumerate(values))
        self.compiled, self.slots, self.weak = compiled, slots, weak
        self.grid = tuple(grid) + (1,) * (3 - len(grid))

    def run(self, *changed) -> None:
        """Launch the compiled kernel again with ``changed`` in place of the arguments at ``slots``, in order."""
        values = list(self.values)
        for i in self.weak:
            values[i] = values[i]()
            if values[i] is None:
                raise RuntimeError("a prepared launch outlived the tensor it holds weakly: its plans go with that tensor")
        for i, v in zip(self.slots, changed):
            values[i] = v
        self.compiled[self.grid](*values)


_WEIGHT_PLANS: dict[int, dict] = {}


def weight_plans(qw: QuantizedWeight) -> dict:
    """A dict kept per weight while its trellis tensor lives, where ops keep their prepared
    launches by key (the dequantize-once paths; decode_wgmma keeps its own beside its words).
    A launch kept here holds the trellis weakly (``prepare``'s ``weak``): held strongly, the
    trellis would never die, and neither would the dict, the weight or its memory."""
    key = id(qw.trellis)
    plans = _WEIGHT_PLANS.get(key)
    if plans is None:
        plans = _WEIGHT_PLANS[key] = {}
        weakref.finalize(qw.trellis, _WEIGHT_PLANS.pop, key, None)
    return plans


def prepare(kernel, grid: tuple[int, ...], *args, slots: tuple[str, ...] | None, weak: tuple[str, ...] = (),
            **kwargs) -> Prepared | None:
    """``kernel[grid](*args, **kwargs)`` (Triton's own launch), returning a ``Prepared`` whose
    ``run`` takes new values for the parameters named in ``slots``, in that order, and holds the
    tensors of the parameters named in ``weak`` by weak reference; None where the caller keeps
    nothing (``slots`` None) or there is no compiled kernel to keep (the interpreter; the offline
    compile check, whose tensors are on the CPU). Names a kernel does not have raise ValueError,
    before the launch and on every device."""
    sig = _signature(kernel) if slots is not None or weak else ()  # nothing to check or keep otherwise
    names = [name for name, _ in sig]
    if unknown := [n for n in (*(slots or ()), *weak) if n not in names]:
        raise ValueError(f"{getattr(kernel, '__name__', kernel)} has no parameter {unknown[0]!r}")
    if both := set(slots or ()) & set(weak):
        raise ValueError(f"{sorted(both)[0]!r} is both a slot (a new value a run) and held weakly: pick one")
    compiled = kernel[grid](*args, **kwargs)
    if slots is None or _INTERPRETED or compiled is None:
        return None
    values = list(args)
    for name, default in sig[len(args):]:
        values.append(kwargs.get(name, default))
    if not any(isinstance(v, torch.Tensor) and v.is_cuda for v in values):
        return None
    return Prepared(compiled, grid, values, tuple(names.index(n) for n in slots), tuple(names.index(n) for n in weak))


# -- Memory that outlives a call ----------------------------------------------------------------
_KEPT_THREAD = "escha-kept"


@functools.cache
def _allocating_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=_KEPT_THREAD)


def kept(device: torch.device, make: Callable[[], T]) -> T:
    """``make()`` for what escha keeps beyond the call (caches: repacked words, constants,
    workspaces), with its memory from the process's allocator on CUDA devices.

    A caller may route this thread's allocations into a private pool: CUDA-graph trees
    (``torch.compile(mode="reduce-overhead")``, which transformers uses for
    ``generate(cache_implementation="static")``) run a compiled step's first calls so, and refuse
    to go on when tensors made there outlive the step. The pool routing is per thread, so ``make``
    runs on a thread of escha's own, ordered after the caller's stream and before its next work.
    Inside a CUDA-graph capture the caller decides instead (``_cached``): no other thread may
    touch the device then.
    """
    if (device.type != "cuda" or torch.cuda.is_current_stream_capturing()
            or threading.current_thread().name.startswith(_KEPT_THREAD)):  # already there: a make inside a make
        return make()
    device = cuda_device(device)  # the caller's current device, not the worker's
    caller = torch.cuda.current_stream(device)

    def run() -> T:
        with torch.cuda.device(device):
            side = torch.cuda.current_stream(device)
            side.wait_stream(caller)  # what the caller wrote (the weight) is there before make reads it
            value = make()
            caller.wait_stream(side)  # and the caller's next work sees what make wrote
            if isinstance(value, torch.Tensor):
                value.record_stream(caller)  # freed one day: not before the caller's work on it ends
            return value

    try:
        future = _allocating_thread().submit(run)
    except RuntimeError:  # the interpreter is shutting down and took the worker with it
        return make()
    return future.result()


def cuda_device(device: torch.device) -> torch.device:
    """``device`` with its index: a bare "cuda" is the current device (cache keys and other
    threads need the index)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# -- Workspace cache ----------------------------------------------------------------------------
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def workspace(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The reusable scratch for (device, current stream, dtype, shape); allocated on first use only.

    Two callers on one stream are ordered by the stream, so sharing is safe; a tensor from one
    call is overwritten by the next call of the same key, so callers never return it. Keying on
    the stream keeps two streams from racing on one buffer.
    """
    device = cuda_device(device)  # "cuda" and "cuda:0" are one buffer
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream, dtype, tuple(shape))
    buf = _WORKSPACE.get(key)
    if buf is None:
        buf = kept(device, lambda: torch.empty(shape, device=device, dtype=dtype))
        _WORKSPACE[key] = buf
    return buf


# -- Arenas of replayed launches ---------------------------------------------------------------
class Arena:
    """One uint8 buffer per (device, stream) that CUDA graphs captured over it share, and its
    generation. A graph captured over an arena holds its addresses, so it may be replayed only
    while the arena's generation is the one it was captured at; ``stream_arena`` replaces the
    buffer by a larger one (a new generation) when a graph needs more, and the graphs of the old
    one are captured again on their next call. Graphs replayed on one stream run one after the
    other, so they may share it as the workspaces of one stream do (``workspace``)."""

    __slots__ = ("buffer", "generation")

    def __init__(self) -> None:
        self.buffer, self.generation = None, -1


_ARENAS: dict[tuple[int, int], Arena] = {}
ARENA_MIN_BYTES = 1 << 20  # sizes are powers of two from here, so a model grows its arena a few times at most


def stream_arena(device: torch.device, stream: int, nbytes: int = 0) -> Arena:
    """The arena of (``device``, raw ``stream``), made at least ``nbytes`` long: a new, larger
    buffer and generation if the current one is shorter (memory from ``kept``). The old buffer
    lives on while a graph captured over it does (its x and y are views of it): each such graph
    is captured again over the new buffer on its next call, and the old one is freed, in stream
    order, once the last of them is."""
    key = (cuda_device(device).index, stream)
    arena = _ARENAS.get(key)
    if arena is None:
        arena = _ARENAS[key] = Arena()
    if arena.buffer is None or arena.buffer.numel() < nbytes:
        size = max(ARENA_MIN_BYTES, 1 << (nbytes - 1).bit_length())
        arena.buffer = None
        arena.buffer = kept(device, lambda: torch.empty(size, dtype=torch.uint8, device=device))
        arena.generation += 1
    return arena


Parts = list[tuple[tuple[int, ...], torch.dtype]]  # (shape, dtype) of each tensor laid in an arena


def arena_views(arena: Arena, parts: Parts) -> list[torch.Tensor]:
    """Contiguous tensors of the given (shape, dtype) laid one after another in ``arena``'s
    buffer, each at a multiple of 256 bytes (TMA wants 16; 256 keeps every part's rows aligned
    alike); ``arena_bytes`` is the length they need."""
    views, offset = [], 0
    for shape, dtype in parts:
        n = math.prod(shape) * dtype.itemsize
        views.append(arena.buffer[offset:offset + n].view(dtype).view(shape))
        offset += -(-n // 256) * 256
    return views


def arena_bytes(parts: Parts) -> int:
    """The bytes ``arena_views`` takes for ``parts``."""
    return sum(-(-(math.prod(shape) * dtype.itemsize) // 256) * 256 for shape, dtype in parts)


@functools.cache
def capture_stream(index: int) -> torch.cuda.Stream:
    """A stream of escha's own on device ``index`` to capture graphs on (a capture may not run on
    the legacy default stream, where eager callers usually are), made once as torch.cuda.graph
    makes its own. Captures on it hold ``_CAPTURE_LOCK``: two threads capturing at once on one
    stream would merge their graphs."""
    return torch.cuda.Stream(torch.device("cuda", index))


_CAPTURE_LOCK = threading.Lock()


class Replay:
    """A kept plan's launches captured as one CUDA graph over views of its stream's arena
    (``replayed``): x and y are two of those views, and the graph is valid while the arena is at
    ``generation``."""

    __slots__ = ("graph", "arena", "generation", "x", "y")

    def __init__(self, graph, arena: Arena, x: torch.Tensor, y: torch.Tensor) -> None:
        self.graph, self.arena, self.generation, self.x, self.y = graph, arena, arena.generation, x, y


def replayable(x2d: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether an eager call with a kept plan may be ``replayed``: no caller's output (the graph
    writes its own y), x's rows contiguous (the arena's copy of x has that layout, which the
    plan's fixed strides must then describe) and no capture under way (a replay cannot be
    captured; the plan's own launches can)."""
    return (out is None and x2d.stride(1) == 1 and x2d.stride(0) == x2d.shape[1]
            and not torch.cuda.is_current_stream_capturing())


MAX_GRAPHS = 8  # graphs one op keeps a weight a stream: a decode loop needs one or two (its step, its prompt)


def replayed(graphs: dict, key: tuple, x2d: torch.Tensor, parts: Callable[[], Parts],
             launch: Callable[..., None]) -> torch.Tensor | None:
    """A kept plan's call as one CUDA graph replay: x copied into the current stream's arena, the
    graph replayed, y copied out. The graph is kept in ``graphs`` by stream and ``key``, and
    captured on the key's second call on the stream, or again once the arena has grown
    (``stream_arena``). None, with nothing run, on the key's first call on a stream (a warm-up on
    a side stream, as before a capture, then makes no graph and no arena there) and when
    ``graphs`` already holds MAX_GRAPHS others of the stream (a caller whose token count changes
    every call, a server's batch, would otherwise keep a graph for every count): the caller then
    launches its plan.
    ``parts()`` lists the call's tensors, x first and y last (``arena_views``); ``launch(*views)``
    launches the plan's kernels over them. ``key`` must fix everything the launches read besides
    the views (the norms' addresses among them: the graph keeps them).

    Why: an eager call's host time is mostly the kernels' launches through Triton (docs/KERNELS.md,
    "Host time of a call"); this makes them one graph launch and two copies. The copy in and the
    fresh y keep the call's contract: any x of this layout, a y no later call overwrites."""
    index = x2d.device.index
    stream = torch._C._cuda_getCurrentRawStream(index)
    kept_here = graphs.get(stream)
    if kept_here is None:
        kept_here = graphs[stream] = {}
    replay = kept_here.get(key)
    if replay is None:
        if key not in kept_here:  # its first call here: noted (None), not captured
            kept_here[key] = None
            return None
        if sum(r is not None for r in kept_here.values()) >= MAX_GRAPHS:
            return None
    if replay is None or replay.generation != replay.arena.generation:
        tensors = parts()
        arena = stream_arena(x2d.device, stream, arena_bytes(tensors))
        views = arena_views(arena, tensors)
        graph = torch.cuda.CUDAGraph()
        with _CAPTURE_LOCK, torch.cuda.stream(capture_stream(index)):  # nothing runs during a capture
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch(*views)
            finally:
                graph.capture_end()
        replay = kept_here[key] = Replay(graph, arena, views[0], views[-1])
    replay.x.copy_(x2d)
    replay.graph.replay()
    return replay.y.clone()


# -- Shared device functions --------------------------------------------------------------------
@triton.jit
def hadamard_pm1(BLOCK: tl.constexpr, dtype: tl.constexpr):
    """The unnormalized Sylvester matrix H[i, j] = (-1)**popcount(i & j), [BLOCK, BLOCK] in ``dtype``.

    Built from indices in registers, so no constant tensor is copied to the device (a host copy
    is not allowed inside CUDA-graph capture). The parity fold covers BLOCK <= 128.
    """
    i = tl.arange(0, BLOCK)[:, None]
    j = tl.arange(0, BLOCK)[None, :]
    a = i & j
    a = a ^ (a >> 4)
    a = a ^ (a >> 2)
    a = a ^ (a >> 1)
    return (1 - 2 * (a & 1)).to(dtype)


_HADAMARD: dict[tuple[str, torch.dtype, float], torch.Tensor] = {}
_CONSTANTS: dict[tuple[str, int, float, torch.dtype], torch.Tensor] = {}
_DERIVED: dict[tuple, torch.Tensor] = {}
_CAPTURED: list[torch.Tensor] = []  # constants made inside a CUDA-graph capture, for their graph


def _cached(cache: dict, key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[key]``, made by ``make()`` (device ops only) on first use. Inside CUDA-graph capture
    a missing constant is made for that graph alone: its kernels run only when the graph replays,
    so it is not shared with callers outside the graph, and it is kept alive here for the graph's
    replays (the graph holds its address, not the tensor)."""
    v = cache.get(key)
    if v is None:
        v = kept(device, make)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            _CAPTURED.append(v)
        else:
            cache[key] = v
    return v


def constant_vector(device: torch.device, n: int, value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [n] tensor of ``value`` (fp32 unless ``dtype``) on ``device``, made once per (device, n,
    value, dtype) and shared: callers only read it. The per-column scale of a library GEMM whose
    weight scale is one number (dequant_core_fp8); the segment counts of partials that all count
    (transforms.prepare_output). Made with a device op (``_cached``)."""
    return _cached(_CONSTANTS, (str(device), int(n), float(value), dtype), device,
                   lambda: torch.full((n,), value, dtype=dtype, device=device))


def device_constant(key: tuple, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The tensor ``make()`` builds (device ops only: no host copy, so a first call may happen
    inside CUDA-graph capture), once per (``key``, device) and shared: callers only read it
    (``_cached``). For constants a kernel derives from its launch parameters (decode_wgmma's
    segment counts)."""
    return _cached(_DERIVED, (str(device), *key), device, make)


def hadamard_matrix(device: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The unnormalized [128, 128] Sylvester matrix (+-1, exact in any float dtype) times ``scale``
    (a power of two, so still exact) on ``device``, built once per (device, dtype, scale) with device
    ops only (no host copy, so a first call may even happen inside CUDA-graph capture: ``_cached``).
    The tensor-core products of many rows (the prompt paths) load it (``load_hadamard``) instead of
    rebuilding it from indices per program (about ten integer ops per entry); the decode transforms,
    a few rows, use ``hadamard128``'s butterflies instead (docs/KERNELS.md)."""
    if scale <= 0 or math.frexp(scale)[0] != 0.5:
        raise ValueError(f"scale must be a positive power of two (exact), got {scale}")
    return _cached(_HADAMARD, (str(device), dtype, scale), device,
                   lambda: (sylvester_pm1(HAD_BLOCK, device, dtype) * scale).contiguous())


_TORCH_DTYPES = {tl.float16: torch.float16, tl.bfloat16: torch.bfloat16, tl.float32: torch.float32}


def hadamard_operand(device: torch.device, dtype: tl.dtype, scale: float = 1.0) -> torch.Tensor:
    """``hadamard_matrix`` in the torch dtype of the Triton dtype ``dtype`` (a dot operand)."""
    return hadamard_matrix(device, _TORCH_DTYPES[dtype], scale)


@triton.jit
def load_hadamard(h_ptr):
    """The [128, 128] matrix of ``hadamard_matrix`` from global memory (an L2 hit after the
    first program)."""
    i = tl.arange(0, 128)[:, None]
    j = tl.arange(0, 128)[None, :]
    return tl.load(h_ptr + i * 128 + j)


@triton.jit
def hadamard128(x):
    """x [R, 128] (fp32) @ H128, the unnormalized Sylvester matrix, in registers: seven butterfly
    stages (k = 16 a + b splits H128 into H2 factors, one per index bit), no matrix loaded and no
    tensor core, so any R (1, 2, ...) works where tl.dot needs 16 rows.

    Each stage fetches every element's partner of one index bit exactly (the pair's bits summed as
    uint32 over that axis of size 2, modulo 2**32, minus the element's own bits: a register move
    inside a thread, one shuffle across lanes) and forms p + y on the low element of the pair and
    p - y on the high one: one rounding each, the textbook butterfly. (An xor of the pair, via
    ``tl.xor_sum``, compiles the same but is a per-element Python loop in the CPU interpreter.)
    Products with +-1 are exact, so the only rounding is the fp32 adds (7 a result). On sm_90a with a 16-byte-aligned
    [R, 128] tile and 4 warps it compiles to 7 operations per element and, from R = 4, no shared
    memory (offline SASS census in docs/KERNELS.md, "Transforms in registers").
    """
    R: tl.constexpr = x.shape[0]
    y = tl.reshape(x, [R, 2, 2, 2, 2, 2, 2, 2])
    c = tl.reshape(tl.arange(0, 128)[None, :], [1, 2, 2, 2, 2, 2, 2, 2])
    for k in tl.static_range(7):  # axis k + 1 holds index bit 6 - k
        sgn = (1 - 2 * ((c >> (6 - k)) & 1)).to(tl.float32)  # +1 on the pair's low element, -1 on its high one
        y = y * sgn + _bit_partner(y, k + 1)  # an fma with +-1: round(p +- y)
    return tl.reshape(y, [R, 128])


@triton.jit
def _bit_partner(y, AXIS: tl.constexpr):
    """Each element's partner across AXIS (of size 2) of fp32 y, exactly: the pair's bits summed
    as uint32 over that axis, modulo 2**32, minus the element's own (a register move inside a
    thread, one shuffle across lanes)."""
    yi = y.to(tl.uint32, bitcast=True)
    return (tl.sum(yi, axis=AXIS, keep_dims=True) - yi).to(tl.float32, bitcast=True)


@triton.jit
def row_sum128(x):
    """x [R, 128] (fp32) with every element of row r replaced by the row's sum, summed by a fixed
    tree: seven stages, each adding to every element its partner across one index bit (fetched
    exactly, ``_bit_partner``, as in ``hadamard128``). The pair's two sums are a + b and b + a, equal in IEEE
    arithmetic, so the tree and its bits depend on the column indices alone, not on the layout,
    warps or lanes that hold the row; ``tl.sum``'s order does depend on them (and so did a head
    norm's bits on the output transform's launch shape)."""
    R: tl.constexpr = x.shape[0]
    y = tl.reshape(x, [R, 2, 2, 2, 2, 2, 2, 2])
    for k in tl.static_range(7):  # axis k + 1 holds index bit 6 - k
        y = y + _bit_partner(y, k + 1)
    return tl.reshape(y, [R, 128])


@triton.jit
def row_scale_block(scale_ptr, su_ptr, gscale_ptr, n, mask):
    """g*c*su for output channels n, in fp32, multiplied in escha.format.row_scale's order."""
    g = tl.load(gscale_ptr)
    c = tl.load(scale_ptr + n, mask=mask, other=0.0).to(tl.float32)
    su = tl.load(su_ptr + n, mask=mask, other=0).to(tl.float32)
    return g * c * su


# -- Rounding -----------------------------------------------------------------------------------
# One family: round_to. Compiled, it is the hardware conversion (cvt.rn on NVIDIA: round to
# nearest even, subnormals kept, overflow to Inf for fp16/bf16). The CPU interpreter's own
# downcasts are not all correct (bf16 truncates; fp8 loses the carry when rounding crosses a
# power of two), so interpreted runs round in integer arithmetic instead, to the same bits.

@triton.jit
def _rint_small(q):
    """Round-half-even of fp32 0 <= q < 2**22 to an integer (adding 2**23 leaves no fraction bits)."""
    return ((q + 8388608.0) - 8388608.0).to(tl.uint32)


@triton.jit
def f32_to_bf16_rne(x):
    """fp32 -> bf16 in integer arithmetic, round to nearest even (NaN stays NaN, overflow gives Inf)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def f32_to_f16_rne(x):
    """fp32 -> fp16 in integer arithmetic, round to nearest even, with subnormals, Inf on overflow
    and NaN kept."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 16) & 0x8000
    normal = tl.minimum((a + 0xFFF + ((a >> 13) & 1)) >> 13, 0x23C00) - 0x1C000  # 0x7C00 = Inf
    sub = _rint_small(tl.abs(x) * 16777216.0)  # |x| < 2**-14: multiples of 2**-24
    r = tl.where(a >= 0x38800000, normal, sub)
    r = tl.where(a > 0x7F800000, 0x7E00, r)
    return (r | sign).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def f32_to_e4m3_rne(x):
    """fp32 -> fp8 e4m3 (fn) in integer arithmetic, round to nearest even, subnormals included,
    NaN to NaN; other inputs must satisfy |x| < 464 (no saturation)."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # rebias 127 -> 7
    sub = _rint_small(tl.abs(x) * 512.0)  # |x| < 2**-6: multiples of 2**-9
    r = tl.where(a >= 0x3C800000, normal, sub)
    r = tl.where(a > 0x7F800000, 0x7F, r)  # NaN stays NaN (e4m3fn's only NaN code, S.1111.111)
    return (r | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def round_to(x, DT: tl.constexpr):
    """``x`` (fp32, or a narrower float) rounded to nearest even in dtype DT: fp32, fp16, bf16 or
    fp8 e4m3 (for e4m3, |x| < 464). The hardware conversion when compiled, integer arithmetic
    under the interpreter."""
    if _INTERPRETED_C:
        x = x.to(tl.float32)  # exact: the helpers read fp32 bit patterns
        if DT == tl.float16:
            y = f32_to_f16_rne(x)
        elif DT == tl.bfloat16:
            y = f32_to_bf16_rne(x)
        elif DT == tl.float8e4nv:
            y = f32_to_e4m3_rne(x)
        else:
            y = x
    else:
        y = x.to(DT)
    return y
