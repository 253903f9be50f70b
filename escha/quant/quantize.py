"""escha.quantize: W [out, in] -> QuantizedWeight (incoherence, scale search, LDLQ, Viterbi)."""
from __future__ import annotations

import functools
from enum import Enum
from typing import Callable, TypeVar

import torch

from ..format import codebooks
from ..format.bitstream import words_from_states
from ..format.qweight import QuantizedWeight
from ..format.spec import TILE, TILE_WEIGHTS, check_bits, padded
from .encode import EncodeOptions, Progress, encode_tiles
from .greedy import encode_greedy
from .incoherence import Incoherent, make_incoherent
from .ldlq import DEFAULT_DAMP, block_ldl_upper, check_finite_matrix, check_hessian, incoherent_hessian, ldlq
from .scale import ScaleSearch, search_ratio
from .viterbi_cpu import reuse_buffers

GPU_MIN_TILES = 64  # below this the CPU path is as fast as launching kernels


class Encoder(str, Enum):
    """Tile encoder: the exact tail-biting Viterbi, or the greedy baseline."""

    VITERBI = "viterbi"
    GREEDY = "greedy"


def check_weight(w: object, name: str = "W") -> torch.Tensor:
    """A 2-D, non-empty, finite floating tensor, or a ValueError/TypeError naming the problem."""
    return check_finite_matrix(w, name)


def to_tiles(t: torch.Tensor) -> torch.Tensor:
    """[Np, Kp] -> [Np/16, Kp/16, 256], weight j of a tile at (j // 16, j % 16)."""
    np_, kp = t.shape
    return t.reshape(np_ // TILE, TILE, kp // TILE, TILE).permute(0, 2, 1, 3).reshape(
        np_ // TILE, kp // TILE, TILE_WEIGHTS)


def from_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """[tn, tk, 256] -> [16 tn, 16 tk]; inverse of to_tiles."""
    tn, tk = tiles.shape[:2]
    return tiles.reshape(tn, tk, TILE, TILE).permute(0, 2, 1, 3).reshape(tn * TILE, tk * TILE)


def _pick_device(w: torch.Tensor, n_tiles: int, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if w.device.type == "cpu" and torch.cuda.is_available() and n_tiles >= GPU_MIN_TILES:
        return torch.device("cuda")
    return w.device


F = TypeVar("F", bound=Callable)


def _shared_cpu_workspace(fn: F) -> F:
    """Run ``fn`` with one set of CPU DP buffers and one thread governor for all its encodes
    (scale search, every LDLQ column); unused on GPU."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with reuse_buffers():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


@_shared_cpu_workspace
def quantize(W: torch.Tensor, bits: int = 2, hessian: torch.Tensor | None = None, seed: int = 0,
             codebook: str | int = "3inst", *, damp: float = DEFAULT_DAMP,
             scale_search: ScaleSearch | None = ScaleSearch(), encoder: Encoder | str = Encoder.VITERBI,
             progress: Progress | None = None, device: torch.device | str | None = None) -> QuantizedWeight:
    """Quantize a weight matrix W [out, in] to Escha W2 with K = ``bits``.

    Args:
        W: float weight [out, in]; NaN/Inf raise a ValueError naming the first position.
        bits: K, bits per weight (1-4; 2 and 3 are the intended rates).
        hessian: optional E[x x^T] [in, in] of the layer's inputs; enables LDLQ.
        seed: fixes the random sign vectors; the result is deterministic for a given seed.
        codebook: codebook name or id.
        damp: LDLQ damping as a fraction of the Hessian's mean diagonal.
        scale_search: sample and candidates of the global-scale search; None uses the per-K prior.
        encoder: "viterbi" (exact tail-biting DP, the default) or "greedy" (baseline).
        progress: called as progress(done_tiles, total_tiles); see encode.stderr_progress.
        device: where to compute; default CUDA when available and the matrix has >= 64 tiles.

    Returns a QuantizedWeight on W's device.
    """
    check_weight(W)
    check_bits(bits)
    cb = codebooks.get(codebook)
    enc = Encoder(encoder)
    h = None if hessian is None else check_hessian(hessian, W.shape[1])
    np_, kp = padded(W.shape[0]), padded(W.shape[1])
    n_tiles = np_ * kp // TILE_WEIGHTS
    dev = _pick_device(W, n_tiles, device)
    inc = make_incoherent(W.detach().to(dev), seed)  # signs come from a CPU generator: device-independent
    target = inc.target
    table = cb.table(dev).float()
    tiles = to_tiles(target)

    rms = float(target.pow(2).mean().sqrt())
    if rms == 0:  # all-zero weight: g = 0 reproduces it exactly, any walk will do
        states = torch.zeros((*tiles.shape[:2], TILE_WEIGHTS), dtype=torch.int64, device=dev)
        return _assemble(W, inc, states, 0.0, bits, cb.id)
    table_rms = float(table.pow(2).mean().sqrt())
    search = scale_search if enc == Encoder.VITERBI else None  # the search ranks Viterbi errors
    ratio = search_ratio(tiles.reshape(-1, TILE_WEIGHTS), table, bits, search)
    g = rms / (ratio * table_rms)

    done = [0]

    def encode(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1, TILE_WEIGHTS) / g
        if enc == Encoder.GREEDY:
            st = encode_greedy(flat, bits, table)
        else:
            st, _ = encode_tiles(flat, table, bits, EncodeOptions())
        done[0] += flat.shape[0]
        if progress is not None:
            progress(done[0], n_tiles)
        return st.reshape(*t.shape[:-1], TILE_WEIGHTS)

    if h is None:
        states = encode(tiles)
    else:
        u = block_ldl_upper(incoherent_hessian(h, inc.sv, kp), TILE, damp).to(dev)
        col_states: list[torch.Tensor] = []

        def quantize_columns(cols: torch.Tensor, k: int) -> torch.Tensor:
            st = encode(to_tiles(cols)[:, 0])  # [Np/16, 256]: one tile column
            col_states.append(st)
            return from_tiles(table[st][:, None] * g)

        # float64 feedback on CPU (cheap there); float32 on GPU, where the trellis error dominates.
        ldlq(target.double() if dev.type == "cpu" else target, u, quantize_columns)
        states = torch.stack(col_states, dim=1)
    return _assemble(W, inc, states, g, bits, cb.id)


WORDS_CHUNK = 1 << 16  # tiles per words_from_states call: bounds its [T, 256, 16] temporaries


def _assemble(W: torch.Tensor, inc: Incoherent, states: torch.Tensor, g: float, bits: int,
              codebook_id: int) -> QuantizedWeight:
    """Pack (and re-verify) the walks into words on the compute device, then build the weight."""
    flat = states.reshape(-1, TILE_WEIGHTS)
    words = torch.cat([words_from_states(flat[i:i + WORDS_CHUNK], bits)
                       for i in range(0, flat.shape[0], WORDS_CHUNK)])
    words = words.reshape(*states.shape[:2], -1)
    dev = words.device
    return QuantizedWeight(words, inc.su.to(dev), inc.sv.to(dev), inc.scale.to(dev),
                           torch.tensor([g], dtype=torch.float32, device=dev),
                           tuple(W.shape), bits, codebook_id).to(W.device)
