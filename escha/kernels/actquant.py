"""Activation side of every prefill path: x -> x' = Hk (sv * pad(x)), in e4m3 or bf16.

One launch of the input transform (``transforms._input_transform_kernel``, the decode paths'
kernel): each program reads its token's row once for the row's max |x|, then transforms
``tiles`` tiles of ``blocks`` 128-blocks one after another, each through the seven fp32
butterfly stages of ``common.hadamard128`` (no matrix, no tensor core), and stores them.

fp8: x' * 2**e in e4m3, e per token from the bound |x'| <= sqrt(128) max|x| so that no value
exceeds 2**8 (< 448: nothing saturates), and xscale = 2**-e, so x'_true = x'.float() * xscale
(the Hadamard's 1/sqrt(128) is applied before the rounding). A power of two costs no rounding of
its own; values below e4m3's normal range (2**-6 of the bound's 2**8) lose relative precision,
which the GEMM tests' tolerance and the paths' error against fp64 bound (docs/KERNELS.md,
"Prefill"). A row holding a NaN or an infinity comes out NaN, its values and its scale (e4m3 has
no infinity), so the product's row is NaN, as through the reference.
bf16: bf16(x'), unscaled, no row pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK
from ..norm import RowNorm
from .common import FP8_DTYPE, check_operands
from .transforms import prepare_input


@dataclass(frozen=True)
class ActQuantConfig:
    """Launch shape of the activation transform; ``actquant_config`` is the rule that picks it.

    A program takes ``tiles`` tiles of ``blocks`` Hadamard blocks (a power of two) of one token,
    one after another: the grid is [M, ceil(Kp / 128 / (blocks * tiles))].
    """

    blocks: int
    tiles: int

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.blocks & (self.blocks - 1) or self.tiles < 1:
            raise ValueError(f"blocks must be a power of two and tiles at least 1, got {self}")


def actquant_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> ActQuantConfig:
    """The rule: a whole row a program, in tiles of 16 blocks where they divide the row and of
    8 otherwise (fewer for rows of fewer blocks; the last tile's blocks past the row are masked).
    The note at the end of this file has the measurements; M and the device do not change the
    choice."""
    nkb = qw.padded_shape[1] // HAD_BLOCK
    blocks = min(16 if nkb % 16 == 0 else 8, 1 << (nkb - 1).bit_length())
    return ActQuantConfig(blocks=blocks, tiles=-(-nkb // blocks))


def actquant(x: torch.Tensor, qw: QuantizedWeight, *, fp8: bool = True, config: ActQuantConfig | None = None,
             norm: RowNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., in] (fp16/bf16/fp32) -> (x' [M, Kp], xscale [M] or None), x' = Hk (sv * pad(x)).

    fp8=True: x' is float8_e4m3fn and x'_true[m] = x'[m].float() * xscale[m], xscale a power of
    two (the Hadamard's 1/sqrt(128) is applied before the rounding). fp8=False: x' is bfloat16,
    already normalized. ``config`` overrides ``actquant_config``. ``norm`` (an ``escha.RowNorm``
    whose weight has x's dtype and device: ``RowNorm.fusable``) applies the RMSNorm before the
    layer to each row first, as the model computes it.
    """
    check_operands(x, qw, "actquant")
    return prepare_actquant(x.reshape(-1, x.shape[-1]), qw, fp8, config, keep=False, norm=norm)[:2]


def prepare_actquant(x2d: torch.Tensor, qw: QuantizedWeight, fp8: bool, config: ActQuantConfig | None,
                     keep: bool, norm: RowNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                    tuple | None]:
    """``actquant`` of x2d [M, in] (checked by the caller; any strides) and, with ``keep``, its
    launch prepared to run again (a one-element tuple of ``common.Prepared``, slots
    ``transforms.INPUT_SLOTS``), else (or where nothing is kept, ``common.prepare``) None. x2d
    must have unit column stride for it to apply again, and a norm the same eps: callers key on
    both."""
    if x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    cfg = config or actquant_config(qw, x2d.shape[0], x2d.device)
    out, xscale, plan = prepare_input(x2d, qw, keep=keep, fp8=fp8, bf16=not fp8, blocks=cfg.blocks,
                                      tiles=cfg.tiles, norm=norm)
    return out, xscale, None if plan is None else (plan,)


def run_actquant(x2d: torch.Tensor, qw: QuantizedWeight, fp8: bool, prepared: tuple,
                 norm: RowNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``prepare_actquant``'s launch again on a new x2d (and norm weight) of the same key."""
    m = x2d.shape[0]
    kp = qw.padded_shape[1]
    out = torch.empty((m, kp), device=x2d.device, dtype=FP8_DTYPE if fp8 else torch.bfloat16)
    xscale = torch.empty((m,), device=x2d.device, dtype=torch.float32) if fp8 else None
    prepared[0].run(x2d, out, out if xscale is None else xscale, x2d if norm is None else norm.weight)
    return out, xscale

# Configuration note. The activation pass was two launches of tensor-core kernels (a [64, 128]
# tile a program against the loaded +-1 matrix): pass 1 wrote each block's true max |x'|, pass 2
# reduced them to the row's scale (448 / max), transformed the block again and stored e4m3 (in git
# history before this file's rewrite). One launch of the input transform replaces both. Measured
# on the H200 (benchmarks/results/actquant_h200/, bench_prefill.py's part-actquant arms, us, one
# process each; the two passes from the A/B run's base tree):
#
#   gate_up (40 blocks a row), M = 512 / 2048 / 8192      down (68 blocks), same M
#   two passes       12.6 /  37.0 / 136.7                 18.6 / 60.7 / 234.2
#   rule (8 x 5)      6.0 /  18.2 /  70.9   (8 x 9)        8.3 / 29.8 / 109.6
#   one tile a prog.  9.6 /  36.2 / 161.3                 18.9 / 83.2 / 398.5
#   half a row        7.2 /  25.0 / 102.7                  9.7 / 36.9 / 156.6
#   4-block tiles     6.8 /  21.0 /  80.2                  9.6 / 34.7 / 127.1
#   16-block tiles    6.0 /  18.9 /  73.9                  8.1 / 28.7 / 111.1
#   32-block tiles    6.6 /  23.1 /  91.7                  8.9 / 33.1 / 133.3
#
# Whole rows a program won at every point: a program's later tiles re-read its row from L2 right
# after the row pass read it, where split rows pay that pass once a program. Tiles of 8 or 16
# blocks are within 4% of each other (16 leaves masked blocks on down's 68 and gate_up's 40: 8
# there). At 8192 tokens on gate_up the pass moves 126 MB (x read, e4m3 written): 46 us at the
# 2.71 TB/s copy rate of this GPU, so the rule runs at 1.5x its memory floor.
