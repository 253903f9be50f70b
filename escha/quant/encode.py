"""Batched tile encoder: tail-biting Viterbi over many 256-weight tiles, memory-bounded.

Picks the Triton kernels on CUDA and the blocked CPU DP (viterbi_cpu.py) elsewhere; the
reference PyTorch path stays selectable (Backend.TORCH). Tiles are cut into batches sized from
free memory on GPU; on CPU the DP bounds its own memory and a batch sets the progress interval.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable

import torch

from ..format.spec import STATE_BITS
from .viterbi import Trellis, viterbi, viterbi_tailbiting
from .viterbi_cpu import block_size as cpu_block_size
from .viterbi_cpu import reuse_buffers, viterbi_cpu

if TYPE_CHECKING:
    from .viterbi_triton import ViterbiLaunch

Progress = Callable[[int, int], None]  # progress(done_tiles, total_tiles)

CPU_BUDGET_BYTES = 1 << 30  # working memory for one batch of the reference path on CPU
GPU_FREE_FRACTION = 0.5  # share of free device memory one batch may take
MAX_BATCH = 16384  # beyond this a batch buys no more parallelism
CPU_BLOCKS_PER_BATCH = 4  # CPU batch = 4 DP blocks (64 tiles at K=2): progress about every second
# Steps of the rotated wrap pass: survivor paths merge within a few dozen steps, so 64 steps on
# each side of the wrap point fix the same overlap bits as the whole tile at half the cost.
DEFAULT_WRAP_WINDOW = 128


class Backend(str, Enum):
    """Which Viterbi implementation runs the DP (all give the same walks).

    AUTO: Triton on CUDA, CPU elsewhere. CPU: blocked min-only DP (viterbi_cpu.py). TORCH: the
    reference path (viterbi.py), slow; kept for comparison. TRITON: the fused kernels.
    """

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"
    CPU = "cpu"


@dataclass(frozen=True)
class EncodeOptions:
    """Knobs of the tile encoder.

    tail_biting: produce cyclic walks (the format requires them); False gives the unconstrained
    optimum, used only to measure what the constraint costs.
    wrap_window: steps of the rotated first pass (None: the whole tile).
    launch: the Triton DP's launch parameters (None: viterbi_triton.viterbi_launch's rule).
    cpu_threads: threads of the CPU DP; None: torch's threads while the machine's other cores
    are idle, one while other processes use them (cpu_threads.py).
    """

    tail_biting: bool = True
    wrap_window: int | None = DEFAULT_WRAP_WINDOW
    backend: Backend = Backend.AUTO
    batch_tiles: int | None = None
    launch: ViterbiLaunch | None = None
    cpu_threads: int | None = None


def resolve_backend(device: torch.device, backend: Backend = Backend.AUTO) -> Backend:
    """The implementation AUTO stands for on ``device``."""
    backend = Backend(backend)
    if backend != Backend.AUTO:
        return backend
    return Backend.TRITON if device.type == "cuda" else Backend.CPU


def bytes_per_tile(trellis: Trellis, n: int, triton_path: bool) -> int:
    """Peak working memory of one tile in a batch (costs, emission buffers, backpointers)."""
    costs = 4 * trellis.n_states * 3
    if triton_path:
        return costs + n * trellis.n_groups
    return costs + (n - 1) * trellis.n_groups * trellis.field_bits // 8


def batch_size(trellis: Trellis, n: int, device: torch.device, backend: Backend) -> int:
    """Tiles per batch that fit the memory budget of ``device``."""
    if backend == Backend.CPU:  # the DP bounds its own memory; the batch only paces progress
        return cpu_block_size(trellis, n) * CPU_BLOCKS_PER_BATCH
    triton_path = backend == Backend.TRITON
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * GPU_FREE_FRACTION)
    else:
        budget = CPU_BUDGET_BYTES
    return max(1, min(MAX_BATCH, budget // bytes_per_tile(trellis, n, triton_path)))


def _viterbi_fn(backend: Backend, launch: ViterbiLaunch | None) -> Callable:
    if backend == Backend.TRITON:
        # Imported where it runs: importing Triton at `import escha` would fix the interpreter
        # mode before `escha demo` chooses it (escha/ops.py).
        from .viterbi_triton import viterbi_triton
        return functools.partial(viterbi_triton, config=launch)
    return viterbi_cpu if backend == Backend.CPU else viterbi


def encode_batch(x: torch.Tensor, values: torch.Tensor, trellis: Trellis,
                 opts: EncodeOptions = EncodeOptions()) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: x float32 [T, n] -> (states int64 [T, n], squared error [T])."""
    fn = _viterbi_fn(resolve_backend(x.device, opts.backend), opts.launch)
    if not opts.tail_biting:
        return fn(x, values, trellis)
    return viterbi_tailbiting(x, values, trellis, opts.wrap_window, fn)


def encode_tiles(x: torch.Tensor, values: torch.Tensor, bits: int,
                 opts: EncodeOptions = EncodeOptions(), progress: Progress | None = None,
                 state_bits: int = STATE_BITS) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode tiles x float32 [T, n] (n = 256 for the format) on x's device.

    Returns (states int64 [T, n], squared error float32 [T]); with tail_biting the walks are cyclic.
    """
    trellis = Trellis(state_bits, bits)
    t_count, n = x.shape
    values = values.float().to(x.device)
    backend = resolve_backend(x.device, opts.backend)
    step = opts.batch_tiles or batch_size(trellis, n, x.device, backend)
    states = torch.empty((t_count, n), dtype=torch.int64, device=x.device)
    err = torch.empty(t_count, dtype=torch.float32, device=x.device)
    shared = (reuse_buffers(trellis, n, t_count, opts.cpu_threads) if backend == Backend.CPU
              else contextlib.nullcontext())
    with shared:
        for lo in range(0, t_count, step):
            hi = min(t_count, lo + step)
            states[lo:hi], err[lo:hi] = encode_batch(x[lo:hi].float().contiguous(), values, trellis, opts)
            if progress is not None:
                progress(hi, t_count)
    return states, err
