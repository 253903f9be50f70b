"""LDLQ: Hessian-aware error feedback across tile columns.

With H = E[x x^T] over the layer's inputs, the output error of W_hat is tr(E H E^T), E = W - W_hat.
The format stores W ~ diag(r) Hn T Hk diag(sv), so in the trellis domain the same loss (up to
the row weighting, which incoherence makes near uniform) is tr(dT H~ dT^T) with
H~ = Hk diag(sv) H diag(sv) Hk on the zero-padded input dimension. Writing H~ = U D U^T with U
block unit upper-triangular (16-wide blocks = one tile column), the error of row vector dT is
(dT U) D (dT U)^T; quantizing tile columns left to right with target
T_k + sum_{i<k} dT_i U_ik makes each block's own rounding error the only term left in block k.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..format.hadamard import block_hadamard
from ..format.spec import TILE

DEFAULT_DAMP = 0.01  # damping: fraction of the mean diagonal added to H
SYMMETRY_RTOL = 1e-4  # |H - H^T| allowed, relative to max |H|
MAX_DAMP_RETRIES = 4  # each retry multiplies the damping by 10


def first_non_finite(t: torch.Tensor) -> tuple[int, str, list[int]] | None:
    """(how many entries are NaN/Inf, "NaN" or "Inf" for the first, its index), or None."""
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    first = bad.nonzero()[0].tolist()
    return int(bad.sum()), "NaN" if bool(torch.isnan(t[tuple(first)])) else "Inf", first


def check_finite_matrix(t: object, name: str, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """A 2-D, non-empty, finite floating tensor (of ``shape`` if given), or a ValueError/TypeError
    naming the problem and the first non-finite entry."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be [in, in] = {list(shape)} for this weight, got {list(t.shape)}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out, in], got shape {list(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty: shape {list(t.shape)}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be floating point, got {t.dtype}")
    found = first_non_finite(t)
    if found is not None:
        count, kind, (r, c) = found
        raise ValueError(f"{name} has {count} non-finite values; first is {kind} at [{r}, {c}]")
    return t


def check_hessian(h: object, n_in: int) -> torch.Tensor:
    """A finite, symmetric [n_in, n_in] tensor with no negative diagonal entry, as float64
    (symmetrised), or a clear error."""
    h = check_finite_matrix(h, "hessian", (n_in, n_in))
    h64 = h.double()
    scale = float(h64.abs().max())
    asym = float((h64 - h64.T).abs().max())
    if asym > SYMMETRY_RTOL * max(scale, 1e-30):
        raise ValueError(f"hessian is not symmetric: max |H - H^T| = {asym:.3g} (max |H| = {scale:.3g})")
    low = float(h64.diagonal().min())
    if low < 0:  # E[x x^T] has no negative diagonal entry: a sign error upstream, not a damping matter
        i = int(h64.diagonal().argmin())
        raise ValueError(f"hessian must be E[x x^T] (positive semi-definite): diagonal entry [{i}, {i}] is {low:.3g}")
    return (h64 + h64.T) / 2


def incoherent_hessian(h: torch.Tensor, sv: torch.Tensor, kp: int) -> torch.Tensor:
    """H~ = Hk diag(sv) pad(H) diag(sv) Hk, float64 [Kp, Kp]; padded inputs carry no energy."""
    n = h.shape[0]
    hp = torch.nn.functional.pad(h.double(), (0, kp - n, 0, kp - n))
    s = sv.to(device=h.device, dtype=torch.float64)
    hp = hp * s[:, None] * s[None, :]
    return block_hadamard(block_hadamard(hp, dim=0), dim=1)


def block_ldl_upper(h: torch.Tensor, block: int = TILE, damp: float = DEFAULT_DAMP) -> torch.Tensor:
    """U, block unit upper-triangular, with H + damp*mean(diag)*I = U D U^T (D block diagonal).

    Computed as the block LDL of the order-reversed matrix, then reversed back. The damping
    grows tenfold per retry if H is too far from positive definite; a ValueError if it never works.
    """
    n = h.shape[0]
    mean_diag = float(h.diagonal().mean())
    base = mean_diag if mean_diag > 0 else 1.0
    eye = torch.eye(n, dtype=h.dtype, device=h.device)
    hr = h.flip(0, 1)
    d = damp
    for _ in range(MAX_DAMP_RETRIES):
        chol, info = torch.linalg.cholesky_ex(hr + d * base * eye)
        if int(info) == 0:
            break
        d *= 10
    else:
        raise ValueError(f"hessian is not positive definite even with damping {d / 10:g} x mean diagonal")
    diag_blocks = chol.unflatten(0, (-1, block)).unflatten(2, (-1, block)).diagonal(dim1=0, dim2=2)
    # diag_blocks: [block, block, nb] -> per-block inverse, assembled block-diagonal.
    inv = torch.linalg.inv(diag_blocks.permute(2, 0, 1))
    lower = chol @ torch.block_diag(*inv)
    return lower.flip(0, 1)


def ldlq(target: torch.Tensor, u: torch.Tensor,
         quantize_columns: Callable[[torch.Tensor, int], torch.Tensor],
         block: int = TILE) -> torch.Tensor:
    """Quantize ``target`` [Np, Kp] one column block at a time with LDLQ feedback.

    quantize_columns(targets [Np, block], k) returns the reconstruction of block k. Returns the
    full reconstruction [Np, Kp].
    """
    t = target.clone()
    u = u.to(device=t.device, dtype=t.dtype)
    recon = torch.empty_like(t)
    n_blocks = t.shape[1] // block
    for k in range(n_blocks):
        cols = slice(k * block, (k + 1) * block)
        recon[:, cols] = quantize_columns(t[:, cols], k)
        # Feed the error against the adjusted target forward: e_k = t'_k - q_k, and
        # t'_j += (t_k - q_k) U_kj for later blocks, with t_k the original target (see module doc).
        delta = target[:, cols] - recon[:, cols]
        if k + 1 < n_blocks:
            rest = slice((k + 1) * block, None)
            t[:, rest] += delta @ u[cols, rest]
    return recon


def proxy_loss(w: torch.Tensor, w_hat: torch.Tensor, h: torch.Tensor) -> float:
    """tr(E H E^T) / tr(W H W^T) with E = W - W_hat: the relative output error under inputs of covariance H."""
    w64, h64 = w.double(), h.double().to(w.device)
    e = w64 - w_hat.double().to(w.device)
    num = float(((e @ h64) * e).sum())
    den = float(((w64 @ h64) * w64).sum())
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))
