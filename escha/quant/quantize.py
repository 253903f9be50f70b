"""escha.quantize: W [out, in] -> QuantizedWeight (incoherence, scale search, LDLQ, Viterbi)."""
from __future__ import annotations

import inspect
import math
import warnings
from enum import Enum
from typing import Sequence

import torch

from ..format import codebooks
from ..format.bitstream import words_from_states
from ..format.qweight import QuantizedWeight
from ..format.shard import split_rows
from ..format.spec import TILE, TILE_WEIGHTS, check_bits, padded
from ..progress import ProgressFn, SlowWorkWarning, bar, format_seconds, wanted
from .encode import EncodeOptions, encode_tiles
from .estimate import encoder_tiles_per_s, estimate_seconds
from .greedy import encode_greedy
from .incoherence import Incoherent, make_incoherent
from .ldlq import DEFAULT_DAMP, block_ldl_upper, check_finite_matrix, check_hessian, incoherent_hessian, ldlq
from .scale import ScaleSearch, search_ratio
from .viterbi_cpu import reuse_buffers

GPU_MIN_TILES = 64  # below this the CPU path is as fast as launching kernels
BAR_MIN_SECONDS = 2.0  # the automatic progress bar is drawn for work estimated to take longer
SLOW_SECONDS = 60.0  # a SlowWorkWarning is given for work estimated to take longer


class Encoder(str, Enum):
    """Tile encoder: the exact tail-biting Viterbi, or the greedy baseline."""

    VITERBI = "viterbi"
    GREEDY = "greedy"


def check_encoder(encoder: Encoder | str) -> Encoder:
    """The Encoder named by ``encoder``, or a ValueError listing the valid names."""
    try:
        return Encoder(encoder)
    except ValueError:
        valid = ", ".join(e.value for e in Encoder)
        raise ValueError(f"encoder must be one of {valid}; got {encoder!r}") from None


def tile_count(shape: tuple[int, int]) -> int:
    """Tiles (16 x 16 weights) of an [out, in] weight after padding to the format's blocks."""
    return padded(shape[0]) * padded(shape[1]) // TILE_WEIGHTS


def slow_notice(shape: tuple[int, int], n_tiles: int, bits: int, device: torch.device,
                seconds: float, what: str = "quantizing") -> str:
    """One line: how long the exact encoder will take on ``device`` and what a GPU would take."""
    rate = encoder_tiles_per_s(bits, device, torch.get_num_threads())
    gpu = estimate_seconds(n_tiles, bits, "cuda")
    where = ("a CUDA GPU is available: pass device='cuda'" if torch.cuda.is_available()
             else "on a machine with a CUDA GPU")
    return (f"{what} {shape[0]}x{shape[1]} ({n_tiles:,} tiles at K={bits}) will take about "
            f"{format_seconds(seconds)} on the {device.type.upper()} (~{rate:.0f} tiles/s); an H200 "
            f"takes ~{format_seconds(gpu)} ({where})")


# The magnitudes the encoder's float32 arithmetic takes without its squares over- or underflowing
# (row RMS, the global scale): W's largest |w| must lie in [MIN_MAGNITUDE, MAX_MAGNITUDE] unless W is 0.
MIN_MAGNITUDE, MAX_MAGNITUDE = 2.0**-50, 2.0**50


def check_weight(w: object, name: str = "W") -> torch.Tensor:
    """A 2-D, non-empty, finite floating tensor whose largest magnitude the encoder takes, or a
    ValueError/TypeError naming the problem."""
    w = check_finite_matrix(w, name)
    top = float(w.detach().abs().max())
    if top > MAX_MAGNITUDE or 0 < top < MIN_MAGNITUDE:
        raise ValueError(f"{name}'s largest magnitude {top:.3g} is outside what escha quantizes "
                         f"([{MIN_MAGNITUDE:.3g}, {MAX_MAGNITUDE:.3g}], or all zeros): rescale {name}")
    return w


def check_options(seed: object, damp: object, scale_search: object, progress: object) -> None:
    """quantize's keyword arguments, each checked before any work: a TypeError or ValueError naming it."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < 2**63:
        raise ValueError(f"seed must be in [0, 2**63), got {seed}")
    if not isinstance(damp, (int, float)) or isinstance(damp, bool):
        raise TypeError(f"damp must be a number, got {type(damp).__name__} {damp!r}")
    if not math.isfinite(damp) or damp <= 0:
        raise ValueError(f"damp must be positive and finite (a fraction of the Hessian's mean diagonal), got {damp}")
    if scale_search is not None and not isinstance(scale_search, ScaleSearch):
        raise TypeError(f"scale_search must be a ScaleSearch or None, got {type(scale_search).__name__}")
    if progress is not None and not isinstance(progress, bool):
        if not callable(progress):
            raise TypeError(f"progress must be None, True, False or a callable(done, total), got {progress!r}")
        try:
            inspect.signature(progress).bind(0, 1)
        except TypeError:
            raise TypeError(f"progress must take two arguments (done, total): {progress!r} does not") from None
        except ValueError:  # a builtin without a signature: taken on trust
            pass


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


def quantize(W: torch.Tensor, bits: int = 2, hessian: torch.Tensor | None = None, seed: int = 0,
             codebook: str | int = "3inst", *, damp: float = DEFAULT_DAMP,
             scale_search: ScaleSearch | None = ScaleSearch(), encoder: Encoder | str = Encoder.VITERBI,
             progress: bool | ProgressFn | None = None, device: torch.device | str | None = None) -> QuantizedWeight:
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
        progress: None (default): a progress bar on stderr when it is a terminal and the
            encode is estimated to take over 2 s, and a SlowWorkWarning before an encode
            estimated to take over a minute on the CPU; True: both, terminal or not; False:
            neither; a callable: called as progress(done_tiles, total_tiles), nothing drawn.
        device: where to compute; default CUDA when available and the matrix has >= 64 tiles.

    Returns a QuantizedWeight on W's device. Every argument is checked before any work: a bad
    one raises a TypeError or ValueError naming it (W's largest magnitude must lie in
    [2**-50, 2**50], or W be all zeros).
    """
    check_weight(W)
    check_bits(bits)
    check_options(seed, damp, scale_search, progress)
    cb = codebooks.get(codebook)
    enc = check_encoder(encoder)
    h = None if hessian is None else check_hessian(hessian, W.shape[1])
    kp = padded(W.shape[1])
    n_tiles = tile_count(tuple(W.shape))
    dev = _pick_device(W, n_tiles, device)
    # One set of CPU DP buffers and one thread governor for all the encodes below (scale search,
    # every LDLQ column); unused on GPU.
    with reuse_buffers(), _reporter(progress, tuple(W.shape), n_tiles, bits, dev, enc,
                                    scale_search is not None) as report:
        return _encode_weight(W, bits, h, seed, cb, enc, damp, scale_search, dev, kp, report)


def quantize_shared(Ws: Sequence[torch.Tensor], bits: int = 2, hessian: torch.Tensor | None = None, seed: int = 0,
                    **kwargs) -> list[QuantizedWeight]:
    """Quantize weights that read one input (q, k, v; gate, up) together, so they run as one product.

    The weights are stacked by rows, each but the last padded to whole 128-blocks, and quantized
    as one matrix by ``quantize`` (same arguments; ``hessian`` is their shared input's): they get
    one set of input signs and one global scale, each row keeps its own scale, and each returned
    weight is a valid QuantizedWeight of its own shape. ``escha.format.shard.concat_rows`` stacks
    them back into one weight at no cost, so one input transform, one GEMM and one output
    transform serve them all (``escha.nn.share_inputs``).
    """
    if isinstance(Ws, torch.Tensor) or not isinstance(Ws, Sequence) or len(Ws) == 0:
        raise TypeError("Ws must be a non-empty sequence of 2-D weight tensors")
    for i, w in enumerate(Ws):
        check_weight(w, f"Ws[{i}]")
    if len({int(w.shape[1]) for w in Ws}) != 1:
        raise ValueError(f"weights that share an input need equal in_features; got shapes {[tuple(w.shape) for w in Ws]}")
    last = len(Ws) - 1
    stacked = torch.cat([torch.nn.functional.pad(w.detach().float().to(Ws[0].device),
                                                 (0, 0, 0, 0 if i == last else padded(w.shape[0]) - w.shape[0]))
                         for i, w in enumerate(Ws)])
    qw = quantize(stacked, bits, hessian, seed, **kwargs)
    return [p.clone() for p in split_rows(qw, [int(w.shape[0]) for w in Ws])]


def _encode_weight(W: torch.Tensor, bits: int, h: torch.Tensor | None, seed: int, cb, enc: Encoder, damp: float,
                   scale_search: ScaleSearch | None, dev: torch.device, kp: int, report: "_Report") -> QuantizedWeight:
    """quantize's work once its arguments are checked: incoherence, scale, (LDLQ +) encoding, packing."""
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
        base = done[0]
        if enc == Encoder.GREEDY:
            st = encode_greedy(flat, bits, table)
        else:
            st, _ = encode_tiles(flat, table, bits, EncodeOptions(),
                                 progress=lambda d, _total: report.to(base + d))
        done[0] = base + flat.shape[0]
        report.to(done[0])
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


class _Report:
    """Where quantize's progress goes: a tqdm bar, a caller's function, or nowhere."""

    def __init__(self, total: int, fn: ProgressFn | None = None, show: bool = False) -> None:
        self.total, self.fn, self.done = total, fn, 0
        self.bar = bar(total, "escha.quantize", True, unit="tile") if show else None

    def to(self, done: int) -> None:
        """Record that ``done`` tiles of ``total`` are encoded."""
        if done <= self.done:
            return
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done
        if self.fn is not None:
            self.fn(done, self.total)

    def close(self) -> None:
        """Close the progress bar, if one is shown."""
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "_Report":
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # also when interrupted: the bar's line ends where the work stopped


def _reporter(progress: bool | ProgressFn | None, shape: tuple[int, int], n_tiles: int, bits: int,
              dev: torch.device, enc: Encoder, scale_search: bool) -> _Report:
    """Decide, from the estimated time, whether to warn and draw (see quantize's ``progress``)."""
    if callable(progress) and not isinstance(progress, bool):
        return _Report(n_tiles, fn=progress)
    if progress is False or enc != Encoder.VITERBI:  # greedy is fast: drawn only when asked
        return _Report(n_tiles, show=progress is True)
    seconds = estimate_seconds(n_tiles, bits, dev, threads=torch.get_num_threads(), scale_search=scale_search)
    if dev.type == "cpu" and seconds >= SLOW_SECONDS:
        # stacklevel 3: the caller of escha.quantize (through this helper)
        warnings.warn(slow_notice(shape, n_tiles, bits, dev, seconds), SlowWorkWarning, stacklevel=3)
    return _Report(n_tiles, show=progress is True or (wanted(None) and seconds >= BAR_MIN_SECONDS))


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
