"""The reference codec: plain PyTorch, CPU or GPU, written for clarity. Every kernel is gated on it."""
from __future__ import annotations

import torch

from . import codebooks
from .bitstream import states_from_words
from .hadamard import block_hadamard
from .qweight import QuantizedWeight
from .spec import HAD_BLOCK, TILE


def decode_tiles(words: torch.Tensor, bits: int, codebook: codebooks.Codebook | str | int = 0) -> torch.Tensor:
    """Tile words [..., 8K] -> fp16 tiles [..., 16, 16]; weight j sits at (j // 16, j % 16)."""
    cb = codebook if isinstance(codebook, codebooks.Codebook) else codebooks.get(codebook)
    values = cb.values(states_from_words(words, bits))
    return values.unflatten(-1, (TILE, TILE))


def decode_trellis(qw: QuantizedWeight) -> torch.Tensor:
    """The core matrix T, fp16 [Np, Kp]: tile (tn, tk) fills rows 16tn.., columns 16tk.."""
    tiles = decode_tiles(qw.trellis, qw.bits, qw.codebook)  # [tn, tk, 16, 16]
    tn, tk = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(tn * TILE, tk * TILE)


def row_scale(qw: QuantizedWeight) -> torch.Tensor:
    """fp32 [Np]: g * c * su, the output-side diagonal."""
    return qw.gscale.float() * qw.scale.float() * qw.su.float()


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """W_hat = diag(g*c*su) Hn T Hk diag(sv), cropped to the original shape; float32, the exact
    value rounded once (docs/FORMAT.md section 5).

    Hn T Hk = (Hn_pm1 T Hk_pm1) / 128 with the +-1 matrices. For 3INST every T is a multiple of
    2**-13 below 4, so every partial sum of Hn_pm1 T Hk_pm1 is a multiple of 2**-13 below 2**16:
    exact in float64, in any summation order. Its product with the float32 row scale needs at most
    24 + 29 = 53 bits, so it is exact too, and the one rounding is the cast to float32.
    """
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"dequantize expects a QuantizedWeight, got {type(qw).__name__}")
    t = decode_trellis(qw).double()
    w = block_hadamard(t, dim=1, normalized=False) * qw.sv.double()[None, :]
    w = block_hadamard(w, dim=0, normalized=False) * (row_scale(qw).double()[:, None] / HAD_BLOCK)
    return w[: qw.shape[0], : qw.shape[1]].float().contiguous()


def input_transform(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [..., in] -> x' = Hk (sv * pad(x)) [..., Kp], float32: the activation side of a GEMM."""
    kp = qw.padded_shape[1]
    xp = torch.nn.functional.pad(x.float(), (0, kp - x.shape[-1]))
    return block_hadamard(xp * qw.sv.float(), dim=-1)


def output_transform(z: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """z [..., Np] (= x' T^T) -> y [..., out] = crop((Hn z) * g*c*su), float32."""
    y = block_hadamard(z.float(), dim=-1) * row_scale(qw)
    return y[..., : qw.shape[0]]


def matmul_reference(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """y = x @ W_hat^T in float32 through the transform domain; equals x @ dequantize(qw).T."""
    z = input_transform(x, qw) @ decode_trellis(qw).float().T
    return output_transform(z, qw)
