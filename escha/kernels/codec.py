"""The 3INST codec as Triton device functions, shared by every kernel.

Two implementations of each step, selected by a constexpr in the calling kernel:

* pure Triton (``window16``, ``window16_u32``, ``threeinst``): runs everywhere, the interpreter
  included, and is the fallback and the reference for the PTX path;
* inline PTX (``window16_ptx``, ``threeinst_ptx``): ``tl.inline_asm_elementwise`` with the
  instructions the codec maps onto on NVIDIA GPUs: ``shf`` (funnel shift) for the state window,
  ``mad.lo.u32`` for the LCG, ``lop3.b32`` (LUT 0x6A = (a & b) ^ c) for the mask/xor, two
  ``prmt.b32`` to pair the fp16 halves of two states and one ``add.f16x2`` for both sums.

``CodecPath`` names the two; configs carry one (``codec_path`` picks it for a device) and kernels
take ``USE_PTX: tl.constexpr`` and call ``state_values``/``decode_block``, which dispatch at
compile time.
"""
from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from ..format.codebooks import ThreeInst
from .common import ptx_enabled

# The 3INST constants (escha.format.codebooks.ThreeInst) as constexprs, so the Triton code folds
# them, and spelled into the PTX below.
MUL = tl.constexpr(ThreeInst.MUL)
ADD = tl.constexpr(ThreeInst.ADD)
MASK = tl.constexpr(ThreeInst.MASK)
XOR = tl.constexpr(ThreeInst.XOR)
_LCG_MASK_XOR = {"mul": ThreeInst.MUL, "add": ThreeInst.ADD, "mask": f"0x{ThreeInst.MASK:08X}",
                 "xor": f"0x{ThreeInst.XOR:08X}"}
_THREEINST_ASM = tl.constexpr("""{{
        .reg .b32 a, b, lo, hi;
        mad.lo.u32 a, $1, {mul}, {add};
        mad.lo.u32 b, $2, {mul}, {add};
        lop3.b32 a, a, {mask}, {xor}, 0x6A;
        lop3.b32 b, b, {mask}, {xor}, 0x6A;
        prmt.b32 lo, a, b, 0x5410;
        prmt.b32 hi, a, b, 0x7632;
        add.rn.f16x2 $0, lo, hi;
        }}""".format(**_LCG_MASK_XOR))


class CodecPath(enum.Enum):
    """Which instruction sequence decodes states inside a kernel."""

    TRITON = "triton"  # portable Triton ops; the only path under TRITON_INTERPRET=1
    PTX = "ptx"  # inline PTX (NVIDIA only)


def codec_path(device: torch.device) -> CodecPath:
    """PTX where the device allows it (common.ptx_enabled), the pure-Triton codec elsewhere."""
    return CodecPath.PTX if ptx_enabled(device) else CodecPath.TRITON


@triton.jit
def window16(w0, w1, off):
    """The 16-bit state at bit ``off`` (0..31) of word w0, running on into w1 (MSB-first stream)."""
    v = (w0.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | w1.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((v >> (48 - off).to(tl.uint64)) & 0xFFFF).to(tl.uint32)


@triton.jit
def window16_u32(w0, w1, off):
    """``window16`` with 32-bit operations only (off in 0..31).

    The funnel ``(w0 << off) | (w1 >> (32 - off))`` is split as ``(w1 >> 1) >> (31 - off)`` so
    that off == 0 never shifts by 32 (undefined on 32-bit lanes).
    """
    a = w0.to(tl.uint32, bitcast=True)
    b = w1.to(tl.uint32, bitcast=True)
    o = off.to(tl.uint32)
    hi = (a << o) | ((b >> 1) >> (31 - o))
    return hi >> 16


@triton.jit
def window16_ptx(w0, w1, off):
    """``window16`` as one funnel shift (``shf.l.clamp``: high word of {w0:w1} << off) and a shift."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; shf.l.clamp.b32 t, $2, $1, $3; shr.u32 $0, t, 16; }",
        "=r,r,r,r",
        [w0.to(tl.uint32, bitcast=True), w1.to(tl.uint32, bitcast=True), off.to(tl.uint32)],
        dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def threeinst(state):
    """3INST value (fp16) of uint32 states in [0, 65535]."""
    x = state.to(tl.uint32) * MUL + ADD
    x = (x & MASK) ^ XOR
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo + hi


@triton.jit
def threeinst_ptx(state):
    """3INST value (fp16) of uint32 states, two states per asm block.

    mad + lop3 per state, then prmt 0x5410 gathers both low halves and prmt 0x7632 both high
    halves into one register each, and a single add.f16x2 produces both values (the fp16 sum
    is what the reference rounds to: see escha.format.codebooks.ThreeInst).
    """
    return tl.inline_asm_elementwise(
        _THREEINST_ASM,
        "=r,r,r",
        [state.to(tl.uint32)],
        dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def state_values(w0, w1, off, USE_PTX: tl.constexpr):
    """fp16 3INST values of the windows at bit ``off`` of (w0, w1): the whole codec of one weight."""
    if USE_PTX:
        v = threeinst_ptx(window16_ptx(w0, w1, off))
    else:
        v = threeinst(window16_u32(w0, w1, off))
    return v


@triton.jit
def _synth_word(idx):
    """A cheap, index-dependent word for the codec-only ablation (stands in for a load)."""
    return (idx.to(tl.uint32) * 0x9E3779B1) ^ 0x5BD1E995


@triton.jit
def decode_block(tr_ptr, tn0, tk0, KT, BITS: tl.constexpr, BN: tl.constexpr, BKT: tl.constexpr,
                 USE_PTX: tl.constexpr, ABLATION: tl.constexpr = 0):
    """fp16 core block T[16*tn0 : 16*tn0 + BN, 16*tk0 : 16*tk0 + 16*BKT] from the trellis words.

    ``tr_ptr`` points at int32 words laid out [Np/16, KT, 8*BITS]. The block is built in a 3-D
    shape [BN rows, BKT tiles, 16 columns] so that a row's words are loaded once per tile and
    broadcast over its 16 columns in registers, then flattened to [BN, 16*BKT].
    ABLATION (benchmark only, escha.kernels._ablation; 0 in every real use) replaces the loads
    (1) or the codec (2) to split the runtime.
    """
    W: tl.constexpr = 8 * BITS
    n = tl.arange(0, BN)[:, None, None]
    r = n % 16
    t = tl.arange(0, BKT)[None, :, None]
    c = tl.arange(0, 16)[None, None, :]
    tile = ((tn0 + n // 16) * KT + (tk0 + t)) * W  # [BN, BKT, 1] first word of each tile
    if BITS == 2:
        # Row r of a K=2 tile is the window at 2c of word r running into word r+1.
        i0 = tile + r
        i1 = tile + (r + 1) % 16
        if ABLATION == 1:
            w0 = _synth_word(i0)
            w1 = _synth_word(i1)
        else:
            w0 = tl.load(tr_ptr + i0)
            w1 = tl.load(tr_ptr + i1)
        off = c * 2
    else:
        # General K: row r starts at stream bit 16*K*r; its 16 windows lie in three words.
        p0 = r * (16 * BITS)
        b = p0 // 32
        ia = tile + b
        ib = tile + (b + 1) % W
        ic = tile + (b + 2) % W
        if ABLATION == 1:
            wa = _synth_word(ia)
            wb = _synth_word(ib)
            wc = _synth_word(ic)
        else:
            wa = tl.load(tr_ptr + ia)
            wb = tl.load(tr_ptr + ib)
            wc = tl.load(tr_ptr + ic)
        prel = (p0 % 32) + BITS * c  # bit of the window relative to word a, in 0..76
        first = prel < 32
        second = prel < 64
        w0 = tl.where(first, wa, tl.where(second, wb, wc))
        w1 = tl.where(first, wb, wc)  # a window starting in word c never reaches the word after it
        off = prel % 32
    if ABLATION == 2:
        v = (w0 + off).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        v = state_values(w0, w1, off, USE_PTX)
    return tl.reshape(v, (BN, BKT * 16))
