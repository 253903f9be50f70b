"""The 3INST codec as Triton device functions, shared by every kernel.

Two implementations of each step, selected by a constexpr in the calling kernel:

* pure Triton (``window16``, ``window16_u32``, ``threeinst``): runs everywhere, the interpreter
  included, and is the fallback and the reference for the PTX path;
* inline PTX (``window16_ptx``, ``threeinst_ptx``): ``tl.inline_asm_elementwise`` with the
  instructions the codec maps onto on NVIDIA GPUs: ``shf`` (funnel shift) for the state window,
  ``mad.lo.u32`` for the LCG, ``lop3.b32`` (LUT 0x6A = (a & b) ^ c) for the mask/xor, two
  ``prmt.b32`` to pair the fp16 halves of two states and one ``add.f16x2`` for both sums.

``CodecPath`` names the two; kernels take ``USE_PTX: tl.constexpr`` and call
``decode_states``/``state_values`` below, which dispatch at compile time.
"""
from __future__ import annotations

import enum
import os

import torch
import triton
import triton.language as tl

# 3INST constants (escha.format.codebooks.ThreeInst); duplicated as module constants so the
# Triton functions can fold them. tests/test_codec_kernels.py checks they agree.
MUL = 89226354
ADD = 64248484
MASK = 0x8FFF8FFF
XOR = 0x3B603B60


class CodecPath(enum.Enum):
    """Which instruction sequence decodes states inside a kernel."""

    TRITON = "triton"  # portable Triton ops; the only path under TRITON_INTERPRET=1
    PTX = "ptx"  # inline PTX (NVIDIA only)


def default_codec_path(device: torch.device) -> CodecPath:
    """PTX on NVIDIA GPUs; the pure-Triton codec elsewhere (and always under the interpreter)."""
    if device.type == "cuda" and torch.version.cuda is not None and os.environ.get("TRITON_INTERPRET") != "1":
        return CodecPath.PTX
    return CodecPath.TRITON


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
    x = state.to(tl.uint32) * 89226354 + 64248484
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
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
        """{
        .reg .b32 a, b, lo, hi;
        mad.lo.u32 a, $1, 89226354, 64248484;
        mad.lo.u32 b, $2, 89226354, 64248484;
        lop3.b32 a, a, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        lop3.b32 b, b, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        prmt.b32 lo, a, b, 0x5410;
        prmt.b32 hi, a, b, 0x7632;
        add.rn.f16x2 $0, lo, hi;
        }""",
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


class Ablation(enum.IntEnum):
    """Measurement-only kernel variants that split the runtime (never a default: results are wrong)."""

    NONE = 0
    CODEC_ONLY = 1  # no weight loads: words are synthesized from their indices
    LOADS_ONLY = 2  # no codec: each loaded word's low half is reinterpreted as the fp16 weight


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


# -- Rounding helpers ---------------------------------------------------------------------------
# Float narrowing written out in integer arithmetic, round-to-nearest-even, so that every kernel
# rounds identically on the GPU and under the CPU interpreter (whose own float downcasts do not
# round to nearest-even). They cost a handful of integer ops per element and are used only in
# prologues/epilogues, never in the codec loop.

@triton.jit
def _rint_small(q):
    """Round-half-even of fp32 0 <= q < 2**22 to an integer (adding 2**23 leaves no fraction bits)."""
    return ((q + 8388608.0) - 8388608.0).to(tl.uint32)


@triton.jit
def f32_to_bf16_rne(x):
    """fp32 -> bf16, round to nearest even (NaN stays NaN, overflow gives Inf)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = tl.where(nan, (u >> 16) | 0x40, r)
    return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def f32_to_f16_rne(x):
    """fp32 -> fp16, round to nearest even, with subnormals, Inf on overflow and NaN kept."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 16) & 0x8000
    normal = tl.minimum((a + 0xFFF + ((a >> 13) & 1)) >> 13, 0x23C00) - 0x1C000  # 0x7C00 = Inf
    sub = _rint_small(tl.abs(x) * 16777216.0)  # |x| < 2**-14: multiples of 2**-24
    r = tl.where(a >= 0x38800000, normal, sub)
    r = tl.where(a > 0x7F800000, 0x7E00, r)
    return (r | sign).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def f32_to_e4m3_rne(x):
    """fp32 -> fp8 e4m3 (fn), round to nearest even; inputs must satisfy |x| < 464 (no saturation)."""
    u = x.to(tl.uint32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)  # rebias 127 -> 7
    sub = _rint_small(tl.abs(x) * 512.0)  # |x| < 2**-6: multiples of 2**-9
    r = tl.where(a >= 0x3C800000, normal, sub)
    return (r | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in dtype DT (fp32, fp16, bf16 or fp8 e4m3)."""
    if DT == tl.float16:
        y = f32_to_f16_rne(x)
    elif DT == tl.bfloat16:
        y = f32_to_bf16_rne(x)
    elif DT == tl.float8e4nv:
        y = f32_to_e4m3_rne(x)
    else:
        y = x
    return y
