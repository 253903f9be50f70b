"""Incoherence processing: the forward map from W to the trellis-domain target T (docs/FORMAT.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.hadamard import block_hadamard
from ..format.spec import padded

C_FLOOR = 2.0**-14  # smallest normal float16


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """int8 [n] of +1/-1."""
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(torch.int8)


@dataclass
class Incoherent:
    """W in the rotated domain, with the side information that undoes the rotation."""

    target: torch.Tensor  # float32 [Np, Kp] = Hn diag(su) diag(1/c) W diag(sv) Hk
    su: torch.Tensor  # int8 [Np]
    sv: torch.Tensor  # int8 [Kp]
    scale: torch.Tensor  # float16 [Np], c


def pad_weight(w: torch.Tensor) -> torch.Tensor:
    """Zero-pad [out, in] to whole Hadamard blocks, float32."""
    out, inp = w.shape
    return torch.nn.functional.pad(w.float(), (0, padded(inp) - inp, 0, padded(out) - out))


def make_incoherent(w: torch.Tensor, seed: int) -> Incoherent:
    """Pad, normalise rows to unit RMS (c, stored in fp16), flip signs and rotate both sides."""
    g = torch.Generator().manual_seed(seed)
    wp = pad_weight(w)
    np_, kp = wp.shape
    su, sv = random_signs(np_, g), random_signs(kp, g)
    rms = wp.pow(2).mean(1).sqrt()
    top = float(rms.max()) if rms.numel() else 0.0
    # c is relative to the largest row, so fp16 holds it. It is floored at fp16's smallest normal:
    # a zero (or negligible) row then gets a tiny c, and the output Hadamard's mixing of other
    # rows' trellis error into it is scaled down by c rather than reproduced at full size.
    rel = rms / top if top > 0 else torch.ones_like(rms)
    c = rel.clamp_min(C_FLOOR).to(torch.float16)
    wn = wp / c.float()[:, None]
    wn = wn * su.to(wn.device).float()[:, None] * sv.to(wn.device).float()[None, :]
    target = block_hadamard(block_hadamard(wn, dim=1), dim=0)
    return Incoherent(target, su, sv, c)
