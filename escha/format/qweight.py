"""QuantizedWeight: one Escha W2 matrix (trellis bits plus incoherence side information)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import codebooks
from .spec import HAD_BLOCK, TILE, check_bits, padded, words_per_tile


class FormatError(ValueError):
    """A tensor, file or header that does not follow the Escha W2 format."""


@dataclass
class QuantizedWeight:
    """An [out, in] weight W stored as  W ~ diag(g*c*su) Hn T Hk diag(sv)  (docs/FORMAT.md).

    Attributes:
        trellis: int32 [Np/16, Kp/16, 8*bits], each tile's bitstream words (uint32 patterns).
        su: int8 [Np] output signs (+1/-1).   sv: int8 [Kp] input signs.
        scale: float16 [Np] per-output-channel scale c.   gscale: float32 [1] global scale g.
        shape: the original (out, in).   bits: K.   codebook_id: file id of the codebook.
    """

    trellis: torch.Tensor
    su: torch.Tensor
    sv: torch.Tensor
    scale: torch.Tensor
    gscale: torch.Tensor
    shape: tuple[int, int]
    bits: int
    codebook_id: int = 0
    had_block: int = HAD_BLOCK

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)  # type: ignore[assignment]
        self.validate()

    # -- derived properties -------------------------------------------------------------
    @property
    def out_features(self) -> int:
        """Rows of the original weight (output channels)."""
        return self.shape[0]

    @property
    def in_features(self) -> int:
        """Columns of the original weight (input channels)."""
        return self.shape[1]

    @property
    def padded_shape(self) -> tuple[int, int]:
        """(Np, Kp): both dimensions rounded up to whole Hadamard blocks."""
        return padded(self.shape[0]), padded(self.shape[1])

    @property
    def codebook(self) -> codebooks.Codebook:
        """The registered codebook this weight's states decode through."""
        return codebooks.get(self.codebook_id)

    @property
    def device(self) -> torch.device:
        """The device holding every tensor of the weight."""
        return self.trellis.device

    @property
    def storage_bits(self) -> int:
        """Every stored bit: trellis words plus signs, scales and the global scale."""
        return sum(t.numel() * t.element_size() * 8 for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per original weight, side information and padding included."""
        return self.storage_bits / (self.shape[0] * self.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors, keyed by their suffix in a file."""
        return {"trellis": self.trellis, "su": self.su, "sv": self.sv,
                "scale": self.scale, "gscale": self.gscale}

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        """A copy with every tensor on ``device``."""
        return QuantizedWeight(**{k: v.to(device) for k, v in self.tensors().items()},
                               shape=self.shape, bits=self.bits,
                               codebook_id=self.codebook_id, had_block=self.had_block)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={self.shape}, bits={self.bits}, codebook={self.codebook.name!r}, "
                f"bpw={self.bits_per_weight:.4f}, device={self.device})")

    # -- validation ---------------------------------------------------------------------
    def validate(self, check_values: bool = True) -> None:
        """Raise FormatError naming the first inconsistency between fields."""
        try:
            check_bits(self.bits)
            codebooks.get(self.codebook_id)
        except ValueError as e:
            raise FormatError(str(e)) from None
        if self.had_block != HAD_BLOCK:
            raise FormatError(f"Hadamard block {self.had_block} is not supported (v1 uses {HAD_BLOCK})")
        if len(self.shape) != 2 or min(self.shape) < 1:
            raise FormatError(f"shape must be two positive dimensions, got {self.shape}")
        np_, kp = self.padded_shape
        want = {
            "trellis": ((np_ // TILE, kp // TILE, words_per_tile(self.bits)), torch.int32),
            "su": ((np_,), torch.int8),
            "sv": ((kp,), torch.int8),
            "scale": ((np_,), torch.float16),
            "gscale": ((1,), torch.float32),
        }
        devices = set()
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise FormatError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise FormatError(f"{name} must be {dtype} {list(shape)} for shape {self.shape} "
                                  f"K={self.bits}, got {t.dtype} {list(t.shape)}")
            devices.add(t.device)
        if len(devices) > 1:
            raise FormatError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        if check_values and self.trellis.device.type != "meta":
            for name in ("su", "sv"):
                t = getattr(self, name)
                if bool(((t != 1) & (t != -1)).any()):
                    raise FormatError(f"{name} must hold only +1 and -1")
            for name in ("scale", "gscale"):
                t = getattr(self, name)
                if not bool(torch.isfinite(t).all()):
                    raise FormatError(f"{name} holds NaN or Inf")
