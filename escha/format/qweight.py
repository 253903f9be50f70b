"""QuantizedWeight: one Escha W2 matrix (trellis bits plus incoherence side information)."""
from __future__ import annotations

import operator
from dataclasses import InitVar, dataclass, fields
from typing import Callable, ClassVar, Sequence

import torch

from . import codebooks
from .spec import HAD_BLOCK, TILE, check_bits, padded, words_per_tile


class FormatError(ValueError):
    """A tensor, file or header that does not follow the Escha W2 format."""


def check_shape(shape: object) -> tuple[int, int]:
    """(out_features, in_features) as two positive ints (numpy and 0-d torch integers accepted), or
    a FormatError: a float or a missing dimension is refused, not truncated."""
    try:
        if isinstance(shape, (str, bytes)) or len(shape) != 2 or any(isinstance(s, bool) for s in shape):
            raise TypeError
        out = (operator.index(shape[0]), operator.index(shape[1]))
    except (TypeError, ValueError, RuntimeError):
        raise FormatError(f"shape must be two integers (out_features, in_features), got {shape!r}") from None
    if min(out) < 1:
        raise FormatError(f"shape must be positive, got {out}")
    return out


@dataclass(frozen=True)
class TensorSpec:
    """One stored tensor of a QuantizedWeight (docs/FORMAT.md sections 5 and 7).

    ``shape`` maps (Np, Kp, bits) to the tensor's shape; ``values`` names the rule its values
    follow ("any", "signs": each +1 or -1, "finite"); ``fill`` is the value of a placeholder
    weight (a valid weight that loading replaces); ``axes`` says, for each axis, which weight
    dimension it follows and how many weights one entry covers, ``(dim, weights)``, or None
    (what a block-aligned slice of the weight takes from the tensor: escha.format.shard).
    """

    name: str
    dtype: torch.dtype
    shape: Callable[[int, int, int], tuple[int, ...]]
    values: str
    fill: float
    meaning: str
    axes: tuple[tuple[int, int] | None, ...]


#: The five stored tensors, in file and argument order: the one declaration every reader,
#: writer and kernel entry point derives from.
WEIGHT_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("trellis", torch.int32, lambda np_, kp, bits: (np_ // TILE, kp // TILE, words_per_tile(bits)),
               "any", 0, "each tile's 8*bits bitstream words (uint32 patterns)", ((0, TILE), (1, TILE), None)),
    TensorSpec("su", torch.int8, lambda np_, kp, bits: (np_,), "signs", 1, "output signs", ((0, 1),)),
    TensorSpec("sv", torch.int8, lambda np_, kp, bits: (kp,), "signs", 1, "input signs", ((1, 1),)),
    TensorSpec("scale", torch.float16, lambda np_, kp, bits: (np_,), "finite", 1, "per-output-channel scale c",
               ((0, 1),)),
    TensorSpec("gscale", torch.float32, lambda np_, kp, bits: (1,), "finite", 1, "global scale g", (None,)),
)
TENSOR_NAMES: tuple[str, ...] = tuple(s.name for s in WEIGHT_TENSORS)


@dataclass
class QuantizedWeight:
    """An [out, in] weight W stored as  W ~ diag(g*c*su) Hn T Hk diag(sv)  (docs/FORMAT.md).

    Attributes:
        trellis, su, sv, scale, gscale: the stored tensors, as ``WEIGHT_TENSORS`` declares them.
        shape: the original (out, in).   bits: K.   codebook_id: file id of the codebook.

    Construction validates every field, values included (signs are +-1, scales finite), which
    reads values back to the host; ``trusted`` builds one without that.
    """

    TENSORS: ClassVar[tuple[TensorSpec, ...]] = WEIGHT_TENSORS

    trellis: torch.Tensor
    su: torch.Tensor
    sv: torch.Tensor
    scale: torch.Tensor
    gscale: torch.Tensor
    shape: tuple[int, int]
    bits: int
    codebook_id: int = 0
    had_block: int = HAD_BLOCK
    check_values: InitVar[bool] = True

    def __post_init__(self, check_values: bool) -> None:
        self.shape = check_shape(self.shape)  # type: ignore[assignment]
        self.validate(check_values)

    @classmethod
    def trusted(cls, tensors: Sequence[torch.Tensor], shape: tuple[int, int], bits: int,
                codebook_id: int = 0) -> "QuantizedWeight":
        """A weight over tensors (in ``TENSOR_NAMES`` order) taken from a weight validated before.

        Checks shapes, dtypes and devices but never reads a value, so it does not synchronize
        with the host: it is legal inside CUDA-graph capture (escha.matmul's custom op uses it).
        """
        return cls(*tensors, shape=shape, bits=bits, codebook_id=codebook_id, check_values=False)

    @classmethod
    def placeholder(cls, shape: tuple[int, int], bits: int, codebook_id: int = 0,
                    device: torch.device | str | None = None) -> "QuantizedWeight":
        """A valid weight of this shape whose tensors hold each spec's ``fill`` value."""
        np_, kp = padded(shape[0]), padded(shape[1])
        tensors = [torch.full(s.shape(np_, kp, bits), s.fill, dtype=s.dtype, device=device) for s in cls.TENSORS]
        return cls(*tensors, shape=shape, bits=bits, codebook_id=codebook_id)

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
        """The stored tensors, keyed by their suffix in a file, in ``TENSOR_NAMES`` order."""
        return {name: getattr(self, name) for name in TENSOR_NAMES}

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        """A copy with every tensor on ``device``."""
        return QuantizedWeight(**{k: v.to(device) for k, v in self.tensors().items()},
                               shape=self.shape, bits=self.bits,
                               codebook_id=self.codebook_id, had_block=self.had_block)

    def clone(self) -> "QuantizedWeight":
        """A copy that owns its tensors (a slice's views, ``shard`` or ``split_rows``, become tensors
        of their own, so each is stored and freed alone); values are not checked again."""
        return QuantizedWeight.trusted([t.clone() for t in self.tensors().values()], self.shape, self.bits,
                                       self.codebook_id)

    def shard(self, dim: int, rank: int, world_size: int, parts: Sequence[int] | None = None) -> "QuantizedWeight":
        """Rank ``rank``'s slice of ``world_size`` along ``dim`` (0: output rows, 1: input columns).

        The slice takes whole 128-blocks of the padded dimension, the same number on every rank,
        so it is itself a valid weight with the same global scale (no re-quantization); its
        logical size is the part of the original range inside its blocks (only the last rank's
        can be shorter). ``parts`` splits a fused dimension part by part ([q | k | v]: each rank
        holds its slice of every part, in order). Raises ``escha.format.shard.ShardError`` when
        the blocks do not divide by ``world_size``. The result may share storage with ``self``.
        """
        from .shard import shard_plan, shard_shape, take
        plan = shard_plan(self.shape, dim, rank, world_size, parts)
        tensors = [take(spec, plan, getattr(self, spec.name).__getitem__) for spec in self.TENSORS]
        return QuantizedWeight.trusted(tensors, shard_shape(self.shape, plan), self.bits, self.codebook_id)

    def __repr__(self) -> str:
        return (f"QuantizedWeight(shape={self.shape}, bits={self.bits}, codebook={self.codebook.name!r}, "
                f"bpw={self.bits_per_weight:.4f}, device={self.device})")

    # -- validation ---------------------------------------------------------------------
    def validate(self, check_values: bool = True) -> None:
        """Raise FormatError naming the first inconsistency between fields.

        ``check_values`` also checks the values (signs, finite scales), which reads them back to
        the host; tensors on the meta device have no values to check.
        """
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
        devices = set()
        for spec in self.TENSORS:
            t = getattr(self, spec.name)
            if not isinstance(t, torch.Tensor):
                raise FormatError(f"{spec.name} must be a torch.Tensor, got {type(t).__name__}")
            shape = spec.shape(np_, kp, self.bits)
            if tuple(t.shape) != shape or t.dtype != spec.dtype:
                raise FormatError(f"{spec.name} must be {spec.dtype} {list(shape)} for shape {self.shape} "
                                  f"K={self.bits}, got {t.dtype} {list(t.shape)}")
            devices.add(t.device)
        if len(devices) > 1:
            raise FormatError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
        if check_values and self.trellis.device.type != "meta":
            for spec in self.TENSORS:
                t = getattr(self, spec.name)
                if spec.values == "signs" and bool(((t != 1) & (t != -1)).any()):
                    raise FormatError(f"{spec.name} must hold only +1 and -1")
                if spec.values == "finite" and not bool(torch.isfinite(t).all()):
                    raise FormatError(f"{spec.name} holds NaN or Inf")


# The dataclass fields and the declaration name the same tensors in the same order.
assert tuple(f.name for f in fields(QuantizedWeight))[:len(TENSOR_NAMES)] == TENSOR_NAMES

