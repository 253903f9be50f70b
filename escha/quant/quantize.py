"""escha.quantize: W [out, in] -> QuantizedWeight."""
from __future__ import annotations

import torch

from ..format import codebooks
from ..format.bitstream import words_from_states
from ..format.qweight import QuantizedWeight
from ..format.spec import TILE, TILE_WEIGHTS, check_bits
from .greedy import encode_greedy
from .incoherence import make_incoherent


def check_weight(w: object, name: str = "W") -> torch.Tensor:
    """A 2-D, non-empty, finite floating tensor, or a ValueError/TypeError naming the problem."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {list(w.shape)}")
    if w.numel() == 0:
        raise ValueError(f"{name} is empty: shape {list(w.shape)}")
    if not w.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point, got {w.dtype}")
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        r, c = bad.nonzero()[0].tolist()
        kind = "NaN" if bool(torch.isnan(w[r, c])) else "Inf"
        raise ValueError(f"{name} has {int(bad.sum())} non-finite values; first is {kind} at [{r}, {c}]")
    return w


def to_tiles(t: torch.Tensor) -> torch.Tensor:
    """[Np, Kp] -> [Np/16, Kp/16, 256], weight j of a tile at (j // 16, j % 16)."""
    np_, kp = t.shape
    return t.reshape(np_ // TILE, TILE, kp // TILE, TILE).permute(0, 2, 1, 3).reshape(
        np_ // TILE, kp // TILE, TILE_WEIGHTS)


def quantize(W: torch.Tensor, bits: int = 2, hessian: torch.Tensor | None = None, seed: int = 0,
             codebook: str | int = "3inst") -> QuantizedWeight:
    """Quantize a weight matrix W [out, in] to Escha W2 with K = ``bits``.

    ``seed`` fixes the random sign vectors, so the result is deterministic. The returned weight
    lives on W's device. ``hessian`` (E[x x^T], [in, in]) is accepted by the Hessian-aware
    quantizer; this encoder is the greedy baseline and refuses it rather than ignore it.
    """
    check_weight(W)
    check_bits(bits)
    cb = codebooks.get(codebook)
    if hessian is not None:
        raise NotImplementedError("Hessian-aware quantization is not available in this build")
    inc = make_incoherent(W.detach(), seed)
    table = cb.table(inc.target.device).float()
    rms = float(inc.target.pow(2).mean().sqrt())
    g = rms / float(table.pow(2).mean().sqrt())
    seqs = to_tiles(inc.target / g if g > 0 else inc.target)
    states = encode_greedy(seqs.reshape(-1, TILE_WEIGHTS), bits, table)
    words = words_from_states(states, bits).reshape(*seqs.shape[:2], -1)
    return QuantizedWeight(words, inc.su, inc.sv, inc.scale,
                           torch.tensor([g], dtype=torch.float32), tuple(W.shape), bits, cb.id).to(W.device)
