"""Decode GEMM for Hopper: the trellis decoded straight into wgmma's register A operand.

    z^T [64 weight rows, tokens] += T_blk [64, 128] @ x'^T [128, tokens]     (one warpgroup)

Swap AB as in the portable kernel (decode.py): weight rows fill the wgmma M dimension (one or two
64-row fragments per warpgroup), tokens its N dimension (8..256; the rule takes at most 128), the
activations x' come from shared memory (TMA, a ring of STAGES buffers). Unlike the portable
kernel, the decoded weights never leave the registers: every thread decodes exactly the fp16
values of its own A fragment and the ``wgmma.mma_async`` reads them from registers.

Layout (docs/KERNELS.md, "Register-operand decode"). The A fragment of m64n*k16 (fp16) gives a
thread of warp w, lane 4g + t the rows {16w + g, 16w + g + 8} and, in each 16-wide k step s,
the columns {2t, 2t + 1, 2t + 8, 2t + 9}. The MMA's k order inside a 128-block is ours to choose
(the input transform stores x' in the same order, and a permutation of the sum changes
nothing), so it is chosen to make the fragment decodable:

    MMA column kk = 16 s + 8 h + 2 t + e   holds   T column 16 (2t + h) + s + 8 e

i.e. thread t owns all 16 columns of tiles 2t and 2t + 1 of the block, for its two rows. A tile
row is one 16-weight window sequence, so the thread needs just two 64-bit row windows per tile
row (``pack_words``), and register pairs (e = 0, 1) hold columns s and s + 8, which at K = 2 are
the high and low halves of one funnel shift (``_pair_values``).

The halves codec (``halves``, the rule's at 8 tokens, K = 2 and 3): 3INST's value is the fp16 sum
of the two halves of a 32-bit word. Here a register pair holds those two halves of one weight
and x' is stored twice (the input transform's HALVES order), so the tensor core forms
lo x + hi x and the exact codec's add.f16 of each weight's halves goes; each step runs two MMAs
a fragment. Its weight is the unrounded lo + hi, within half an fp16 ulp of the codec's value (the
tolerance table's 2**-11 weight term); dequantize stays bit-exact.

Words are repacked once per weight (``pack_words``: 64 bits per tile row, 2x the trellis at
K = 2, 1.33x at K = 3) so that a thread's words are two 16-byte shared-memory loads; TMA brings
each step's words with its activation tile, STAGES steps ahead of their use.

Work: the programs of a token block share its row tiles x k-blocks evenly (one wave, or whole
waves, of the programs the SMs hold), each a contiguous run of steps that may cross tiles.
Output: fp32 partials [segments, M, Np] for ``transforms.hadamard_output`` (sum in fixed order,
Hn, row scales), as the portable kernel's split path; no atomics, so results are bitwise
reproducible.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..format.bitstream import words_to_u64
from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK, TILE, words_per_tile
from ..norm import HeadNorm, RowNorm
from .common import (Prepared, Replay, check_codebook, check_operands, dependent_launch_supported,
                     device_capability, device_constant, interpreted, kept, output_tensor, prepare)
from .transforms import KeptPlan, check_head_norm, check_norm, input_columns, plan_key, prepare_input, prepare_output, run_kept
from .triton_compat import smem_reinterpret, tma_async_load

FRAGMENT_ROWS = 64  # weight rows of one A fragment (wgmma M)
BLOCK_K = HAD_BLOCK  # k per loop step: one Hadamard block, 8 tiles
FRAGMENT_WORDS = FRAGMENT_ROWS * BLOCK_K // 8  # 64-bit row windows: 2 words per 16 weights -> 1024
MAX_TOKENS = 128  # tokens per program in the rule (wgmma N; the kernel runs up to 256)
HOPPER_SMS = 132  # SMs of an H100 SXM / H200, for the rule when no device is given
SUPPORTED_BITS = (2, 3)  # the row window holds every state of a row for K <= 3
# A fragment's words as TMA moves them: [8, 128] int32, unswizzled (each thread reads 16-byte runs).
WORDS_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


@functools.cache
def x_smem_layout(block_tokens: int) -> gl.NVMMASharedLayout:
    """Shared layout of an activation tile [block_tokens, 128] fp16 (wgmma's B operand, K-major)."""
    return gl.NVMMASharedLayout.get_default_for([block_tokens, BLOCK_K], gl.float16)


# -- the in-memory layout ---------------------------------------------------------------------

def row_windows(trellis: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [Np/16, Kp/16, 16, 2]: for each tile row r, stream bits [16 K r, 16 K r + 64).

    The state of column c of row r is (v >> (48 - K c)) & 0xFFFF with v = (hi << 32) | lo, for
    every c in 0..15 when K <= 3 (docs/FORMAT.md section 2: the stream is read cyclically).
    """
    nw = words_per_tile(bits)
    u = words_to_u64(trellis)  # [TN, TK, nw]
    start = 16 * bits * torch.arange(TILE, device=trellis.device)  # first bit of each row
    q, o = start // 32, start % 32
    idx = (q[:, None] + torch.arange(3, device=trellis.device)[None, :]) % nw  # [16, 3]
    w = u[:, :, idx]  # [TN, TK, 16, 3] the three words covering bits [start, start + 64 + o)
    o = o[None, None, :]
    hi = ((w[..., 0] << o) | (w[..., 1] >> (32 - o))) & 0xFFFFFFFF
    lo = ((w[..., 1] << o) | (w[..., 2] >> (32 - o))) & 0xFFFFFFFF
    v = torch.stack([hi, lo], dim=-1)
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_words(qw: QuantizedWeight) -> torch.Tensor:
    """The weight's words in the kernel's load order: int32 [Np/128, Kp/128, 2, 1024].

    For each (128-row block, 128-column block), two fragments of 64 rows (f = 0, 1), each 1024
    words ordered [warp w (4), row half mh (2), lane 4g + t (32), tile half h (2), hi/lo (2)]:
    lane (g, t) of warp w holds the windows of tile rows g + 8 mh of the 16-row tile
    8 nb + 4 f + w, in tiles 2t + h of the column block. Each thread's words are two aligned
    16-byte loads, and each load instruction of a warp reads 512 contiguous bytes.
    """
    if qw.bits not in SUPPORTED_BITS:
        raise ValueError(f"the register-operand decode handles K in {SUPPORTED_BITS}, got K={qw.bits}")
    v = row_windows(qw.trellis, qw.bits)  # [TN, TK, 16, 2]
    tn, tk = v.shape[:2]
    # tn = 8 nb + 4 f + w; tk = 8 kb + 2 t + h; row = 8 mh + g
    v = v.reshape(tn // 8, 2, 4, tk // 8, 4, 2, 2, 8, 2)  # nb, f, w, kb, t, h, mh, g, j
    v = v.permute(0, 3, 1, 2, 6, 7, 4, 5, 8)  # nb, kb, f, w, mh, g, t, h, j
    return v.reshape(tn // 8, tk // 8, 2, FRAGMENT_WORDS).contiguous()


class _Packed:
    """What decode_wgmma keeps per weight: the repacked words, their TMA descriptor, the
    prepared launches of each (x layout, settings) it has run (``launch_checked``) and their CUDA graphs
    by stream (``common.replayed``)."""

    __slots__ = ("words", "descs", "plans", "graphs")

    def __init__(self, words: torch.Tensor) -> None:
        self.words = words
        # One TMA box a step: a tile's fragments are 8 consecutive rows each (pack_words' order).
        self.descs = {f: TensorDescriptor.from_tensor(words.view(-1, BLOCK_K), [8 * f, BLOCK_K], WORDS_SMEM_LAYOUT)
                      for f in (1, 2)}
        self.plans: dict[tuple, KeptPlan] = {}  # by transforms.plan_key
        self.graphs: dict[int, dict[tuple, Replay]] = {}  # by stream, then key (common.replayed)


_PACKED: dict[int, _Packed] = {}


def _packed(qw: QuantizedWeight) -> _Packed:
    """The weight's ``_Packed``, made on the first call and kept while its trellis tensor lives."""
    key = id(qw.trellis)
    entry = _PACKED.get(key)
    if entry is None:
        entry = _Packed(kept(qw.device, lambda: pack_words(qw)))
        _PACKED[key] = entry
        weakref.finalize(qw.trellis, _PACKED.pop, key, None)
    return entry


def plan_count() -> int:
    """How many prepared launch sets ``launch_checked`` keeps over every weight (a diagnostic: it should
    stay at a few per weight, one per layout of x and settings seen)."""
    return sum(len(p.plans) for p in _PACKED.values())


def packed_words(qw: QuantizedWeight) -> torch.Tensor:
    """``pack_words(qw)``, computed on the first call for a weight and kept while its trellis
    tensor lives (one repack at load; call once before capturing a CUDA graph)."""
    return _packed(qw).words


def runs_on(device: torch.device, bits: int) -> bool:
    """Whether this kernel can run for a K=bits weight on ``device``: a Hopper GPU (sm_90; wgmma),
    compiled Triton (Gluon has no interpreter), K in SUPPORTED_BITS."""
    return (device.type == "cuda" and not interpreted() and bits in SUPPORTED_BITS
            and device_capability(device) == (9, 0))


def mma_column_order(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [128]: the T column (within a 128-block) that MMA column kk multiplies."""
    kk = torch.arange(BLOCK_K, device=device)
    s, h, t, e = kk // 16, (kk // 8) % 2, (kk // 2) % 4, kk % 2
    return 16 * (2 * t + h) + s + 8 * e


# -- device code ------------------------------------------------------------------------------

@gluon.constexpr_function
def _axis_layout(parent, rank, axis):
    """The 1-D layout that expands (expand_dims on every other axis) to ``axis`` of ``parent``."""
    layout = parent
    for ax in reversed(range(rank)):
        if ax != axis:
            layout = gl.SliceLayout(ax, layout)
    return layout


@gluon.jit
def _iota(N: gl.constexpr, AXIS: gl.constexpr, RANK: gl.constexpr, PARENT: gl.constexpr):
    """arange(N) along AXIS of a RANK-d tensor in layout PARENT (size 1 on the other axes)."""
    x = gl.arange(0, N, layout=_axis_layout(PARENT, RANK, AXIS))
    for ax in gl.static_range(RANK):
        if ax != AXIS:
            x = gl.expand_dims(x, ax)
    return x


# The codec's PTX: two LCG words xa, xb (from a funnel word, or from two states), then the mask/xor
# (lop3, LUT 0x6A = (a & b) ^ c) of each, and each word's fp16 halves summed by one scalar add.f16
# (HADD2 with swizzled operands, on the FMA pipe; ptxas packs a pair with one prmt). The fp8
# GEMM's forms (``*_x16``) xor with 0x4B60 instead of 0x3B60 in each half: the mask clears bits
# 12-14, so this sets the exponent field to 16-19 where 3INST's is 12-15, and each half is 16
# times its value, exactly; their sum is 16 T, exactly (no overflow, no fp16 subnormal: the halves
# are multiples of 2**-13), the weight that GEMM rounds to e4m3 with no multiply. (It took 64 T
# before: two prmt and one add.f16x2 gathered the halves, one mul.f16x2 scaled the pair.)


def _first_states(t: str) -> str:
    """The LCG words of a funnel word's two states (operand ``t``: the pair codec's first half)."""
    return f"""
        shr.u32 sa, {t}, 16;
        mad.lo.u32 xa, sa, 89226354, 64248484;
        mad.lo.u32 xb, {t}, 89226354, 1584945828;
        mad.lo.u32 xb, xa, 0xFFFF0000, xb;"""


def _placed_states(a: str, b: str) -> str:
    """The LCG words of two states, each in the top half of its operand (``_states``)."""
    return f"""
        shr.u32 sa, {a}, 16;
        shr.u32 sb, {b}, 16;
        mad.lo.u32 xa, sa, 89226354, 64248484;
        mad.lo.u32 xb, sb, 89226354, 64248484;"""


def _mask(xor: int) -> str:
    """Each LCG word's halves masked and xored: (x & 0x8FFF) ^ ``xor`` (3INST's 0x3B60; 0x4B60: 16x)."""
    return f"""
        lop3.b32 xa, xa, 0x8FFF8FFF, 0x{xor:04X}{xor:04X}, 0x6A;
        lop3.b32 xb, xb, 0x8FFF8FFF, 0x{xor:04X}{xor:04X}, 0x6A;"""


_MASK = _mask(0x3B60)
_MASK_X16 = _mask(0x4B60)
_SUM_HALVES = """
        mov.b32 {al, ah}, xa;
        mov.b32 {bl, bh}, xb;
        add.rn.f16 $0, al, ah;
        add.rn.f16 $1, bl, bh;
        }"""
_REGS = """{
        .reg .b32 sa, sb, xa, xb;
        .reg .b16 al, ah, bl, bh;"""
_PAIR_VALUES_ASM = gl.constexpr(_REGS + _first_states("$2") + _MASK + _SUM_HALVES)
_STATE_VALUES_ASM = gl.constexpr(_REGS + _placed_states("$2", "$3") + _MASK + _SUM_HALVES)
_PAIR_VALUES_X16_ASM = gl.constexpr(_REGS + _first_states("$2") + _MASK_X16 + _SUM_HALVES)
_STATE_VALUES_X16_ASM = gl.constexpr(_REGS + _placed_states("$2", "$3") + _MASK_X16 + _SUM_HALVES)


@gluon.jit
def _pair_values(t):
    """fp16 3INST values of columns c and c + 8 of a K=2 tile row, t = funnel(hi, lo, 2c).

    t's high half is the state of column c and its low half the state of column c + 8. The
    second state's LCG value is derived with mads on the FMA pipe instead of extracting it:
    t*MUL + ADD*(1 + 2**16) - (x_a << 16) = s_b*MUL + ADD (mod 2**32). The first state is
    t >> 16, a shift on the ALU pipe: taken as mul.hi(t, 2**16) on the FMA pipe instead, the
    calls were 2-13% slower (docs/KERNELS.md, "The codec's pipes"). Then the mask/xor
    (lop3) and each value's two halves summed by one add.f16.
    """
    return gl.inline_asm_elementwise(_PAIR_VALUES_ASM, "=h,=h,r", [t], dtype=(gl.float16, gl.float16), is_pure=True,
                                     pack=1)


@gluon.jit
def _state_values(sa, sb):
    """fp16 3INST values of two states, each in the top 16 bits of its word (``_states``): shr, mad,
    lop3, add.f16 each."""
    return gl.inline_asm_elementwise(_STATE_VALUES_ASM, "=h,=h,r,r", [sa, sb], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


@gluon.jit
def _pair_values_x16(t):
    """16 times ``_pair_values``, exactly (the fp8 GEMM's weights: the xor constant's exponent bits)."""
    return gl.inline_asm_elementwise(_PAIR_VALUES_X16_ASM, "=h,=h,r", [t], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


@gluon.jit
def _state_values_x16(sa, sb):
    """16 times ``_state_values``, exactly (``_pair_values_x16``)."""
    return gl.inline_asm_elementwise(_STATE_VALUES_X16_ASM, "=h,=h,r,r", [sa, sb], dtype=(gl.float16, gl.float16),
                                     is_pure=True, pack=1)


# The halves codec: the lop3 word's two fp16 halves (lo, hi) are one A register pair, multiplied
# by the same x' (stored twice, transforms' HALVES order), so the tensor core forms lo x + hi x
# and the exact codec's sum of each word's halves goes. Its weight is the unrounded lo + hi,
# within half an fp16 ulp of T = fp16(lo + hi).
_HALVES_TAIL = _MASK + """
        mov.b32 {$0, $1}, xa;
        mov.b32 {$2, $3}, xb;
        }"""
_HALVES_REGS = """{
        .reg .b32 sa, sb, xa, xb;"""
_PAIR_HALVES_ASM = gl.constexpr(_HALVES_REGS + _first_states("$4") + _HALVES_TAIL)
_STATE_HALVES_ASM = gl.constexpr(_HALVES_REGS + _placed_states("$4", "$5") + _HALVES_TAIL)


@gluon.jit
def _pair_halves(t):
    """(lo, hi) fp16 halves of columns c and c + 8 of a K=2 tile row, t = funnel(hi, lo, 2c)."""
    return gl.inline_asm_elementwise(_PAIR_HALVES_ASM, "=h,=h,=h,=h,r", [t], dtype=(gl.float16,) * 4,
                                     is_pure=True, pack=1)


@gluon.jit
def _state_halves(sa, sb):
    """(lo, hi) fp16 halves of the 3INST values of two states placed as ``_states`` places them."""
    return gl.inline_asm_elementwise(_STATE_HALVES_ASM, "=h,=h,=h,=h,r,r", [sa, sb], dtype=(gl.float16,) * 4,
                                     is_pure=True, pack=1)


# The register layouts of the decode, shared by the GEMM and the fragment test kernel (so the
# test reads exactly what the GEMM multiplies). FRAGMENT_LAYOUT views a 64 x 128 A fragment as
# [warp, row half, g, s, h, t, e] (``_decode_fragment``); WORDS_LAYOUT holds a thread's 8 words
# as [warp, row half, g, tile half, t, hi/lo] (``pack_words``' order).
FRAGMENT_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 8, 2, 1, 2],
                                                threads_per_warp=[1, 1, 8, 1, 1, 4, 1],
                                                warps_per_cta=[4, 1, 1, 1, 1, 1, 1], order=[6, 1, 4, 3, 5, 2, 0]))
WORDS_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                             warps_per_cta=[4, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0]))

_WAIT_ASM = gl.constexpr("griddepcontrol.wait; // $0")
_RELEASE_ASM = gl.constexpr("griddepcontrol.launch_dependents; // $0")


@gluon.jit
def _grid_dependency(ASM: gl.constexpr):
    """common.wait_for_producer / release_dependents for Gluon kernels (the PTX alone)."""
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _row_windows(w, L7: gl.constexpr):
    """The 64-bit tile-row windows of a thread from the words ``w`` of a step, over [warp, row
    half, g, 1, h, t] of L7, and the tile column s of each state (e = 0; s + 8 for e = 1) over its
    dimension 3: what both codecs decode from."""
    W6: gl.constexpr = gl.SliceLayout(6, L7)
    W5: gl.constexpr = gl.SliceLayout(3, W6)
    hi, lo = gl.split(w)
    hi = gl.expand_dims(gl.convert_layout(hi, W5), 3).to(gl.uint32, bitcast=True)
    lo = gl.expand_dims(gl.convert_layout(lo, W5), 3).to(gl.uint32, bitcast=True)
    v = (hi.to(gl.uint64) << 32) | lo.to(gl.uint64)  # [4, 2, 8, 1, 2, 4]
    return v, _iota(8, 3, 6, W6).to(gl.uint64)


@gluon.jit
def _states(v, s, BITS: gl.constexpr):
    """The 16-bit states of tile columns s and s + 8 (K >= 3: bits [48 - K c, 64 - K c) of the row
    window v; K=2 takes both from one funnel shift instead, ``_pair_values``), each in the top 16
    bits of a 32-bit word (``_placed``); the codec's asm shifts it down. A state inside one word
    is placed by a left shift of that word, which ptxas issues as IMAD.SHL on the FMA pipe, where
    the window's funnel shift and a mask (SGXT or LOP3) are two ALU ops: at K=3, 11 of a row's 16
    states, and the loop's ALU and FMA work about even: 4-9% faster at K=3 than the mask, same
    instruction count (benchmarks/results/k3_placed/h200/)."""
    pa = 48 - BITS * s.to(gl.int32)  # first bit of each state in v
    pb = pa - 8 * BITS
    return _placed(v, pa), _placed(v, pb)


@gluon.jit
def _placed(v, p):
    """The 16 bits of v from bit p in the top half of a 32-bit word: a left shift of the word that
    holds them (hi from bit 32, lo below 16 bits), else a funnel shift of the window."""
    hi = (v >> 32).to(gl.uint32)
    lo = v.to(gl.uint32)
    in_hi = hi << gl.minimum(gl.maximum(48 - p, 0), 31).to(gl.uint32)
    in_lo = lo << gl.minimum(gl.maximum(16 - p, 0), 31).to(gl.uint32)
    across = (v >> gl.maximum(p - 16, 0).to(gl.uint64)).to(gl.uint32)
    return gl.where(p >= 32, in_hi, gl.where(p <= 16, in_lo, across))


@gluon.jit
def _decode_fragment(w, BITS: gl.constexpr, L7: gl.constexpr, A_LAYOUT: gl.constexpr):
    """The [64, 128] fp16 A operand (MMA column order) from the words ``w`` of _load_words.

    L7 views the fragment as [warp, row half, g, s, h, t, e]: MMA row 16 warp + 8 half + g,
    MMA column 16 s + 8 h + 2 t + e, holding tile 2t + h, column s + 8 e of that row.
    """
    v, s = _row_windows(w, L7)
    if BITS == 2:
        t = ((v << (2 * s)) >> 32).to(gl.uint32)  # funnel: states of columns s and s + 8
        va, vb = _pair_values(t)
    else:
        va, vb = _state_values(*_states(v, s, BITS))
    a = gl.reshape(gl.join(va, vb), [64, 128])
    return gl.convert_layout(a, A_LAYOUT, assert_trivial=True)


@gluon.jit
def _word_row(tile, kb, NKB, FRAGS: gl.constexpr):
    """First row (of the [-1, 128] int32 view of pack_words) of the words of row tile ``tile`` (64
    FRAGS rows) at k-block ``kb``: 16 rows per 128-row block and k-block, so a tile's FRAGS
    fragments are 8 FRAGS consecutive rows (one TMA box)."""
    frag = tile * FRAGS
    return (((frag // 2) * NKB + kb) * 2 + frag % 2) * 8


@gluon.jit
def _fragment_words(w_smem, index, WL: gl.constexpr):
    """A fragment's words of a step, from shared-memory block ``index``: [warp * 2 + row half,
    (g, t, tile half, hi/lo)] viewed as WL's [warp, row half, g, tile half, t, hi/lo]."""
    return w_smem.index(index).reshape([4, 2, 8, 4, 2, 2]).permute([0, 1, 2, 4, 3, 5]).load(WL)


@gluon.jit
def _next_step(tile, kb, NKB):
    """The step after (tile, k-block kb): the next k-block, or the next tile's first."""
    kb += 1
    tile += (kb == NKB).to(gl.int32)
    return tile, gl.where(kb == NKB, 0, kb)


@gluon.jit
def _halves(w, BITS: gl.constexpr, L7: gl.constexpr):
    """The halves of a fragment's weights from the words ``w`` of a step, over [warp, row half, g,
    s, h, t]: (a_lo, a_hi) of tile column s and (b_lo, b_hi) of column s + 8."""
    v, s = _row_windows(w, L7)
    if BITS == 2:
        t = ((v << (2 * s)) >> 32).to(gl.uint32)
        return _pair_halves(t)
    else:
        return _state_halves(*_states(v, s, BITS))


@gluon.jit
def _decode_halves(w, BITS: gl.constexpr, L7: gl.constexpr, A_LAYOUT: gl.constexpr):
    """The two [64, 128] fp16 A operands of the halves codec: columns s (and s + 8) of each tile
    row, each register pair (e = 0, 1) the (lo, hi) halves of one weight."""
    a_lo, a_hi, b_lo, b_hi = _halves(w, BITS, L7)
    a = gl.convert_layout(gl.reshape(gl.join(a_lo, a_hi), [64, 128]), A_LAYOUT, assert_trivial=True)
    b = gl.convert_layout(gl.reshape(gl.join(b_lo, b_hi), [64, 128]), A_LAYOUT, assert_trivial=True)
    return a, b


@gluon.jit
def _store_partials(ws_ptr, acc0, acc1, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN: gl.constexpr,
                    FRAGS: gl.constexpr, MMA: gl.constexpr):
    """Program p's part of row tile ``tile`` (accumulators [64, BN] a fragment, layout MMA) as its
    segment of the fp32 partials [segments, M, Np]: segment p - first_program(tile)."""
    # first_program(tile): the largest q with q STEPS / PROGRAMS <= tile * NKB
    seg = p - (((tile * NKB + 1).to(gl.int64) * PROGRAMS + STEPS - 1) // STEPS).to(gl.int32) + 1
    # int32 offsets inside the [BN, Np] slab (BN * Np < 2**31), an int64 scalar base
    tok = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    rows = tile * (64 * FRAGS) + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    offs = tok[None, :] * Np + rows[:, None]
    tmask = tok[None, :] < M - row0
    base = ws_ptr + (seg * M + row0).to(gl.int64) * Np
    gl.store(base + offs, acc0, mask=tmask)
    if FRAGS == 2:
        gl.store(base + offs + 64, acc1, mask=tmask)


@gluon.jit
def _decode_wgmma_kernel(x_desc, w_desc, ws_ptr, M, Np, NKB, STEPS, PROGRAMS,
                         BITS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, FRAGS: gl.constexpr,
                         HALVES: gl.constexpr, PDL: gl.constexpr):
    """Program (p, token block): steps [p STEPS / PROGRAMS, (p + 1) STEPS / PROGRAMS) of the
    token block's STEPS = row tiles x NKB steps (flat index tile * NKB + k-block; a tile is 64
    FRAGS weight rows), each z^T[64 FRAGS rows, BN tokens] += T_blk x'^T_blk.

    Every program gets the same number of steps (to one), so no SM waits on a tail of programs
    (an even split, not a split of whole tiles). A tile's k-range is cut among consecutive
    programs; program p writes its part of tile r as segment p - first_program(r) of the fp32
    partials [segments, M, Np], and the output transform sums each tile's segments in fixed
    order (``segment_counts``): bitwise reproducible.

    Each step's activation tile x' [BN, 128] and its words [8 FRAGS, 128] (the FRAGS fragments'
    blocks are consecutive rows of pack_words: one box) arrive by TMA on one mbarrier, STAGES
    steps ahead of their use, across tile boundaries, so the loop never waits on global memory.
    The loop carries its (tile, k-block) and the refill's, and its ring stage and phase, as
    counters: no division by NKB inside it. With FRAGS = 2 the warpgroup decodes two 64-row
    fragments per step against the same activation tile (the second decode overlaps the first
    fragment's MMA). With HALVES each fragment takes two A operands (the halves of columns s and
    s + 8) against the two copies of x' (two activation tiles a step).

    With PDL (programmatic dependent launch) the program starts while the input transform runs:
    it fetches its first STAGES word blocks, which no kernel writes, then waits for x'. It
    releases the output transform after its loop.
    """
    p = gl.program_id(0)
    tb = gl.program_id(1)
    s0 = ((p.to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32)  # int64: p * STEPS can pass 2**31
    n = (((p + 1).to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32) - s0

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    L7: gl.constexpr = FRAGMENT_LAYOUT
    WL: gl.constexpr = WORDS_LAYOUT

    NX: gl.constexpr = 2 if HALVES else 1  # activation tiles [BN, 128] a step (halves: x' twice)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES * NX, BN, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES * FRAGS, 8, 128], w_desc.layout)
    # The same bytes as TMA fills them, one [8 FRAGS, 128] box a stage (unswizzled: row-major).
    W_SMEM: gl.constexpr = w_desc.layout
    w_box = smem_reinterpret(w_smem, gl.int32, [STAGES, 8 * FRAGS, 128], W_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    row0 = tb * BN
    nbytes: gl.constexpr = NX * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    tile = s0 // NKB  # the step being read, as (tile, k-block); then advanced without dividing
    kb = s0 - tile * NKB
    t_in = tile  # the step being fetched
    kb_in = kb
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n)
        tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, FRAGS), 0], bars.index(i), w_box.index(i), pred=i < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)
    if PDL:
        _grid_dependency(_WAIT_ASM)
    t_x = tile  # the activations' k-blocks follow the words' (the tile is not needed)
    kb_x = kb
    for i in gl.static_range(STAGES):
        for hx in gl.static_range(NX):
            tma_async_load(x_desc, [row0, (kb_x * NX + hx) * 128], bars.index(i), x_smem.index(i * NX + hx),
                           pred=i < n)
        t_x, kb_x = _next_step(t_x, kb_x, NKB)

    acc0 = gl.zeros([64, BN], dtype=gl.float32, layout=MMA)
    acc1 = gl.zeros([64, BN], dtype=gl.float32, layout=MMA)
    stage = 0
    phase = 0
    for i in range(n):
        carry = (kb != 0) & (i != 0)  # false at the first step of this program's part of the tile
        xs = x_smem.index(stage * NX).permute((1, 0))
        mbarrier.wait(bars.index(stage), phase)
        w0 = _fragment_words(w_smem, stage * FRAGS, WL)
        if HALVES:
            xs1 = x_smem.index(stage * NX + 1).permute((1, 0))
            a0, b0 = _decode_halves(w0, BITS, L7, A_LAYOUT)
            acc0 = warpgroup_mma(a0, xs, acc0, use_acc=carry, is_async=True)
            acc0 = warpgroup_mma(b0, xs1, acc0, is_async=True)
            # One fragment's operands in registers at a time: two fragments' (128 registers)
            # pushed the build to 231 registers and a hundred more moves a step (offline census).
            acc0, a0, b0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, a0, b0))
            if FRAGS == 2:
                a1, b1 = _decode_halves(_fragment_words(w_smem, stage * FRAGS + 1, WL), BITS, L7, A_LAYOUT)
                acc1 = warpgroup_mma(a1, xs, acc1, use_acc=carry, is_async=True)
                acc1 = warpgroup_mma(b1, xs1, acc1, is_async=True)
                acc1, a1, b1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc1, a1, b1))
        else:
            a0 = _decode_fragment(w0, BITS, L7, A_LAYOUT)
            acc0 = warpgroup_mma(a0, xs, acc0, use_acc=carry, is_async=True)
            if FRAGS == 2:
                a1 = _decode_fragment(_fragment_words(w_smem, stage * FRAGS + 1, WL), BITS, L7, A_LAYOUT)
                acc1 = warpgroup_mma(a1, xs, acc1, use_acc=carry, is_async=True)
                acc0, acc1, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, a0, a1))
            else:
                acc0, a0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, a0))
        # Refill the stage this step read (its MMAs have completed) with the step STAGES ahead.
        j = i + STAGES
        mbarrier.expect(bars.index(stage), nbytes, pred=j < n)
        for hx in gl.static_range(NX):
            tma_async_load(x_desc, [row0, (kb_in * NX + hx) * 128], bars.index(stage), x_smem.index(stage * NX + hx),
                           pred=j < n)
        tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, FRAGS), 0], bars.index(stage), w_box.index(stage),
                       pred=j < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)
        if (kb == NKB - 1) | (i == n - 1):  # the program's part of this tile ends here: store it
            _store_partials(ws_ptr, acc0, acc1, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN, FRAGS, MMA)
        tile, kb = _next_step(tile, kb, NKB)
        stage += 1
        phase ^= (stage == STAGES).to(gl.int32)
        stage = gl.where(stage == STAGES, 0, stage)

    if PDL:
        _grid_dependency(_RELEASE_ASM)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _fragment_kernel(words_ptr, out_ptr, NKB, BITS: gl.constexpr):
    """Test kernel: writes the A fragment the GEMM decodes for (row block, k block) = program id,
    at T[64 nb + row, 128 kb + MMA column], so it can be compared bit for bit with the reference."""
    nb = gl.program_id(0)
    kb = gl.program_id(1)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    L7: gl.constexpr = FRAGMENT_LAYOUT
    WL: gl.constexpr = WORDS_LAYOUT
    off = (((_iota(4, 0, 6, WL) * 2 + _iota(2, 1, 6, WL)) * 32 + _iota(8, 2, 6, WL) * 4 + _iota(4, 4, 6, WL)) * 4
           + _iota(2, 3, 6, WL) * 2 + _iota(2, 5, 6, WL))
    w = gl.load(words_ptr + (((nb // 2) * NKB + kb) * 2 + nb % 2).to(gl.int64) * 1024 + off)
    a = _decode_fragment(w, BITS, L7, A_LAYOUT)
    rows = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, A_LAYOUT))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, A_LAYOUT))
    gl.store(out_ptr + rows[:, None].to(gl.int64) * (NKB * 128) + cols[None, :], a)


def decoded_fragments(qw: QuantizedWeight, words: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 [Np, Kp]: the weight core T as the GEMM's A fragments hold it (MMA column order in
    each 128-block). Equal bit for bit to ``decode_trellis(qw)[:, mma_order]`` (tests)."""
    np_, kp = qw.padded_shape
    words = pack_words(qw) if words is None else words
    out = torch.empty((np_, kp), dtype=torch.float16, device=qw.device)
    _fragment_kernel[(np_ // FRAGMENT_ROWS, kp // BLOCK_K)](words, out, kp // BLOCK_K, BITS=qw.bits, num_warps=4)
    return out


def permute_blocks(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [..., Kp] with column ``order[kk]`` of each 128-column block moved to its column kk."""
    kp = t.shape[-1]
    idx = (torch.arange(kp // BLOCK_K, device=t.device)[:, None] * BLOCK_K + order.to(t.device)[None, :]).reshape(-1)
    return t[..., idx]


def mma_order_core(t: torch.Tensor) -> torch.Tensor:
    """The core T [Np, Kp] with each 128-column block permuted into MMA column order."""
    return permute_blocks(t, mma_column_order(t.device))


# -- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeWgmmaConfig:
    """Launch parameters of the register-operand decode GEMM (see ``decode_wgmma_config``)."""

    block_tokens: int  # wgmma N: tokens per program (power of two, 8..256)
    programs: int  # programs per token block, sharing its row tiles x k-blocks evenly
    stages: int  # activation buffers in the TMA ring
    fragments: int  # 64-row A fragments per program (1 or 2)
    dependent_launch: bool  # the three kernels as programmatic dependents (common.dependent_launch_supported)
    early_start: bool  # with dependent_launch: the GEMM launches as the input transform starts, not as it ends
    max_registers: int | None = None  # ptxas's register cap per thread (None: its own choice)
    halves: bool = False  # the halves codec: weights lo + hi unrounded, two MMAs a fragment and step
    input_blocks: int | None = None  # Hadamard blocks an input-transform program (None: its rule)
    output_shape: tuple[int, int] | None = None  # (tokens, warps) an output-transform program (None: its rule)


#: GEMM programs one SM holds at once, by (K, token block): the registers and shared memory of the
#: sm_90a build of the rule's variant at its REGISTER_CAPS under Triton MEASURED_TRITON, the
#: H200's release (tests/test_decode_wgmma.py checks it against the compiler; other releases may
#: build a variant in fewer registers, never in more than the table allows).
MEASURED_TRITON = (3, 6)
PROGRAMS_PER_SM = {(2, 8): 5, (2, 16): 4, (2, 32): 4, (2, 64): 4, (2, 128): 2,
                   (3, 8): 5, (3, 16): 5, (3, 32): 4, (3, 64): 4, (3, 128): 2}
#: ptxas's register cap where the rule sets one, by (K, token block): the 64-token builds take 167
#: registers uncapped at M not a multiple of 16 (3 programs an SM) and 128 capped, without spills
#: (4 an SM); K=3's 16-token build takes 98 uncapped there and 96 capped (5 an SM, as its build for
#: M a multiple of 16); K=2's 16-token build holds 5 an SM uncapped (95 registers) but ran 2-3%
#: faster capped at 128 (4 an SM: ptxas's schedule; note at the end of this module). Since
#: ``partial_rows`` those blocks launch only their build for M a multiple of 16, which holds the
#: same programs an SM uncapped (offline); the caps of (2, 64) and (3, 16) stay because a cap
#: changes ptxas's schedule, and the builds without them were not timed.
REGISTER_CAPS = {(2, 16): 128, (2, 64): 128, (3, 16): 96, (3, 32): 128, (3, 64): 128}
MIN_STEPS = 2  # k-blocks a program takes at least, where that leaves FILL_PER_SM programs an SM or more
FILL_PER_SM = 2.5  # below it (a narrow weight), programs of one or two k-blocks fill the wave instead
LATE_PER_SM = 2  # below it, the GEMM starts as the input transform ends, not as it starts


def register_cap(bits: int, block_tokens: int) -> int | None:
    """The rule's register cap for a K=bits weight's block of ``block_tokens`` (None: ptxas's choice)."""
    return REGISTER_CAPS.get((bits, block_tokens))


def tiles_and_steps(padded_shape: tuple[int, int], fragments: int) -> tuple[int, int]:
    """The row tiles of ``fragments`` 64-row fragments of a weight of padded shape (Np, Kp), and
    its (row tile, k-block) steps: what a token block's programs share."""
    np_, kp = padded_shape
    tiles = np_ // (FRAGMENT_ROWS * fragments)
    return tiles, tiles * (kp // BLOCK_K)


def grid_programs(steps: int, per_sm: int, sms: int, token_blocks: int) -> int:
    """The rule's programs per token block for a weight of ``steps`` (row tile, k-block) steps:
    one wave (``per_sm`` programs on each of ``sms`` SMs, shared among the token blocks), each
    program at least MIN_STEPS k-blocks; where that floor leaves fewer than FILL_PER_SM programs
    an SM, the wave (or one program a step) without it."""
    wave = triton.cdiv(per_sm * sms, token_blocks)
    programs = max(1, min(steps // MIN_STEPS, wave))
    if programs * token_blocks < FILL_PER_SM * sms:
        programs = min(steps, wave)
    return programs


def starts_early(programs: int, sms: int, token_blocks: int) -> bool:
    """Whether the rule launches the GEMM as the input transform starts (else as it ends): where
    its grid gives every SM LATE_PER_SM programs or more."""
    return programs * token_blocks >= LATE_PER_SM * sms


def decode_wgmma_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DecodeWgmmaConfig:
    """The rule: tokens padded to a power of two >= 8 (at most 128 per program); one fragment
    (64 rows) per program, with the halves codec at 8 tokens and the exact codec above; an
    activation ring 3 deep, 2 at 64 tokens so that 4 programs fit an SM (``rule_variant``), and
    ptxas register caps where they keep a program an SM or give a faster schedule
    (``register_cap``, REGISTER_CAPS); one wave of
    programs, as many as the SMs hold at once (PROGRAMS_PER_SM), shared among the token blocks,
    each program at least MIN_STEPS k-blocks unless a narrow weight's grid would then leave the
    SMs short (``grid_programs``); dependent launches wherever the device has them (sm_90 always
    does), the GEMM starting early (as the input transform starts) unless its grid gives an SM
    fewer than two programs (``starts_early``). Measured on the H200 (note at the end of this
    module)."""
    return config_with_programs(qw, m, None, device)


def config_with_programs(qw: QuantizedWeight, m: int, programs: int | None,
                         device: torch.device | None = None) -> DecodeWgmmaConfig:
    """The rule's configuration with ``programs`` programs per token block instead of its own
    (None: its own), and the start the rule gives that grid (``starts_early``): what
    benchmarks/fit_splitk.py sweeps."""
    if m < 1:
        raise ValueError(f"need at least one token, got {m}")
    return _config(*qw.padded_shape, qw.bits, m, programs, device)


def rule_variant(m: int, bits: int) -> tuple[int, int, int, bool]:
    """(block_tokens, fragments, stages, halves) the rule takes for m tokens of a K=bits weight,
    whatever its shape: tokens padded to a power of two from 8 to MAX_TOKENS; one fragment; the
    halves codec at 8 tokens (K = 2 and 3); a ring of 2 at 64 tokens and of 3 elsewhere (module
    note)."""
    block_tokens = min(MAX_TOKENS, max(8, triton.next_power_of_2(m)))
    return block_tokens, 1, 2 if block_tokens == 64 else 3, block_tokens == 8


def gemm_source(bits: int, block_tokens: int, stages: int, fragments: int, pdl: bool = True,
                halves: bool = False, multiples_of_16: tuple[str, ...] = (), one_token: bool = False):
    """The GEMM kernel specialized as a launch with these settings specializes it (16-byte
    aligned partials, and the integer arguments named in ``multiples_of_16``, e.g. ("M", "Np"),
    divisible by 16, as Triton specializes a launch whose values are; with ``one_token`` M is the
    constant 1, as Triton makes it for a launch at M = 1), for ``triton.compile`` on a machine
    without a GPU (the tests' and the census's sm_90a builds)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"x_desc": f"tensordesc<fp16[{block_tokens}, {BLOCK_K}],{x_smem_layout(block_tokens)!r}>",
           "w_desc": f"tensordesc<i32[{8 * fragments}, {BLOCK_K}],{WORDS_SMEM_LAYOUT!r}>", "ws_ptr": "*fp32",
           "M": "constexpr" if one_token else "i32", "Np": "i32", "NKB": "i32", "STEPS": "i32", "PROGRAMS": "i32",
           "BITS": "constexpr", "BN": "constexpr", "STAGES": "constexpr", "FRAGS": "constexpr",
           "HALVES": "constexpr", "PDL": "constexpr"}
    return GluonASTSource(_decode_wgmma_kernel, sig,
                          constexprs={"BITS": bits, "BN": block_tokens, "STAGES": stages, "FRAGS": fragments,
                                      "HALVES": halves, "PDL": pdl, **({"M": 1} if one_token else {})},
                          attrs={(list(sig).index(name),): [["tt.divisibility", 16]]
                                 for name in ("ws_ptr", *multiples_of_16)})


@functools.lru_cache(maxsize=4096)
def _config(np_: int, kp: int, bits: int, m: int, programs: int | None,
            device: torch.device | None) -> DecodeWgmmaConfig:
    """config_with_programs for a K=bits weight of padded shape (np_, kp): kept per argument set,
    since every decode call asks for it."""
    block_tokens, fragments, stages, halves = rule_variant(m, bits)
    on_gpu = device is not None and device.type == "cuda" and torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else HOPPER_SMS
    steps = tiles_and_steps((np_, kp), fragments)[1]
    token_blocks = triton.cdiv(m, block_tokens)
    if programs is None:  # one wave: every SM busy to the end (note at the end of this module)
        programs = grid_programs(steps, PROGRAMS_PER_SM.get((bits, block_tokens), 1), sms, token_blocks)
    elif not 1 <= programs <= steps:
        raise ValueError(f"programs must be 1..{steps} (row tiles x k-blocks), got {programs}")
    return DecodeWgmmaConfig(block_tokens=block_tokens, programs=programs, stages=stages, fragments=fragments,
                             dependent_launch=device is None or dependent_launch_supported(device),
                             early_start=starts_early(programs, sms, token_blocks),
                             max_registers=register_cap(bits, block_tokens),
                             halves=halves)


def segment_counts(programs: int, tiles: int, kblocks: int, fragments: int,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [tiles x fragments]: for each 64-row group of the weight, how many programs cut its
    tile's k-range when ``programs`` programs share ``tiles`` x ``kblocks`` steps evenly (program
    p takes steps [p S / programs, (p + 1) S / programs), S = tiles x kblocks): the partials it
    has. Device ops only (``common.device_constant``)."""
    steps = tiles * kblocks
    r = torch.arange(tiles, dtype=torch.int64, device=device)

    def program(step: torch.Tensor) -> torch.Tensor:  # the program whose steps hold ``step``
        return -(-(step + 1) * programs // steps) - 1

    counts = program((r + 1) * kblocks - 1) - program(r * kblocks) + 1
    return counts.repeat_interleave(fragments).to(torch.int32)


def summed_partials(ws: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """fp64 [M, Np]: each 64-row group's written partials of ``ws`` [segments, M, Np] summed (the
    others are not read): the GEMM's product without the output transform (tests, benchmarks)."""
    out = torch.zeros(ws.shape[1:], dtype=torch.float64, device=ws.device)
    for g, c in enumerate(counts.tolist()):
        out[:, 64 * g:64 * g + 64] = ws[:c, :, 64 * g:64 * g + 64].double().sum(0)
    return out


@functools.lru_cache(maxsize=1024)
def _most_segments(programs: int, tiles: int, kblocks: int) -> int:
    """The largest of ``segment_counts``: the partials' first dimension (kept per grid)."""
    return int(segment_counts(programs, tiles, kblocks, 1).max())


def decode_wgmma(x: torch.Tensor, qw: QuantizedWeight, *, config: DecodeWgmmaConfig | None = None,
                 out: torch.Tensor | None = None, norm: RowNorm | None = None,
                 head_norm: HeadNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T on a Hopper GPU (any number of tokens), in x's dtype.

    x may be fp16, bf16 or fp32, any strides. The weight's words are repacked on the first call
    (``packed_words``). ``out``, if given, is a preallocated [M, out_features] tensor of x's
    dtype with unit column stride. ``norm`` (weight of x's dtype) is applied to x first, in the
    input transform: norm(x) @ W_hat^T; ``head_norm`` to the output's heads, in the output transform.
    """
    check_call(x, qw, "decode_wgmma", norm, head_norm)
    return launch_checked(x, qw, config, out, norm, head_norm)


def check_call(x: torch.Tensor, qw: QuantizedWeight, op: str, norm: RowNorm | None = None,
               head_norm: HeadNorm | None = None) -> None:
    """A decode op's checks of its operands (``op`` names it in the one-line errors): the common
    ones, the 3INST codebook, a Hopper GPU for a supported K, and norms its transforms can apply
    (a kept plan's call reaches no other check of them)."""
    check_operands(x, qw, op)
    check_codebook(qw, op)
    if not runs_on(x.device, qw.bits):
        raise ValueError(f"{op} runs on Hopper GPUs (sm_90) for K in {SUPPORTED_BITS}; "
                         f"got {x.device} and K={qw.bits} (escha.matmul picks another path there)")
    check_norm(x, norm, op)
    check_head_norm(x, head_norm, qw.padded_shape[0], op)  # y has x's dtype and device


def launch_checked(x: torch.Tensor, qw: QuantizedWeight, config: DecodeWgmmaConfig | None = None,
                   out: torch.Tensor | None = None, norm: RowNorm | None = None,
                   head_norm: HeadNorm | None = None) -> torch.Tensor:
    """``decode_wgmma`` on operands the caller has checked (it does; so does escha.matmul's dispatch
    table, for the path its rule chose; compile_check calls it off the GPU): allocate and launch.

    The first call for a weight, a layout of x and a set of settings launches through Triton
    and keeps the three launches prepared (``transforms.KeptPlan``). Later calls with the same
    key run them again (``transforms.run_kept``): eager calls replay them as one CUDA graph;
    inside a capture, into a caller's output or from x with rows not contiguous, they allocate and
    launch them again.
    """
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or decode_wgmma_config(qw, m, x.device)
    packed = _packed(qw)
    key = plan_key("decode_wgmma", qw, x2d, cfg, norm, head_norm, out)
    plan = packed.plans.get(key)
    if plan is not None:
        layout = x_smem_layout(cfg.block_tokens)
        y = run_kept(plan, key, packed.graphs, x2d, out, norm, head_norm,
                     lambda: _parts(x2d, qw, plan.segments, cfg), lambda xq: x_descriptor(xq, cfg.block_tokens, layout))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], qw.out_features)
    pdl = cfg.dependent_launch
    xq, inv, pin = prepare_input(x2d, qw, mma_order=True, dependent_launch=pdl,
                                 release_early=pdl and cfg.early_start, norm=norm, halves=cfg.halves,
                                 blocks=cfg.input_blocks, rows=partial_rows(m, cfg.block_tokens))
    ws, counts, pgemm = _gemm(xq, qw, cfg, packed, keep=True)
    y = output_tensor(x, m, qw.out_features, out)
    pout = prepare_output(ws, qw, inv, y, dependent_launch=pdl, head_norm=head_norm, segments=counts,
                          shape=cfg.output_shape)
    if pin is not None and pgemm is not None and pout is not None:
        packed.plans[key] = KeptPlan(ws.shape[0], pin, pgemm, pout)
    return y.reshape(*x.shape[:-1], qw.out_features)


def x_descriptor(xq: torch.Tensor, block_tokens: int, layout: gl.NVMMASharedLayout) -> TensorDescriptor:
    """A decode GEMM's TMA descriptor of x' [rows, columns] (contiguous): boxes of a token block
    by one k-block, landing in shared memory as ``layout``."""
    rows, cols = xq.shape
    return TensorDescriptor(xq, [rows, cols], [cols, 1], [block_tokens, BLOCK_K], layout)


def _parts(x2d: torch.Tensor, qw: QuantizedWeight, segs: int, cfg: DecodeWgmmaConfig) -> list:
    """The (shape, dtype) of a call's x, x', 2**-e, partials and y (``transforms.run_kept``)."""
    m, k = x2d.shape
    np_, kp = qw.padded_shape
    mk = partial_rows(m, cfg.block_tokens)
    return [((m, k), x2d.dtype), ((mk, input_columns(kp, cfg.halves)), torch.float16), ((m,), torch.float32),
            ((segs, mk, np_), torch.float32), ((m, qw.out_features), x2d.dtype)]


def partial_rows(m: int, block_tokens: int) -> int:
    """The GEMM's M for m tokens in blocks of ``block_tokens``: m rounded up to 16 from blocks of
    16, so that every launch runs Triton's build for M a multiple of 16 (1-4% faster at 24 and 56
    tokens: module note); m in blocks of 8. The call allocates x' and the partials with that many
    rows; x' rows past m are left unwritten, so are the partials' rows past m, which the output
    transform never reads (an x' of m rows given to ``gemm_partials``: TMA zero-fills the rest)."""
    return m if block_tokens < 16 else -(-m // 16) * 16


def gemm_partials(xq: torch.Tensor, qw: QuantizedWeight,
                  cfg: DecodeWgmmaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM kernel alone: fp32 partials z^T [segments, ``partial_rows(M, ...)``, Np] of x' (``hadamard_input(...,
    mma_order=True, halves=cfg.halves)``'s fp16 output, [M, Kp], or [M, 2 Kp] with halves)
    against the weight's words, and how many of them each 64-row group has
    (``hadamard_output``'s ``segments``; the others are left unwritten).
    The middle of the three launches of a call; the benchmarks also time it by itself."""
    return _gemm(xq, qw, cfg, _packed(qw), keep=False)[:2]


def _gemm(xq: torch.Tensor, qw: QuantizedWeight, cfg: DecodeWgmmaConfig, packed: _Packed,
          keep: bool) -> tuple[torch.Tensor, torch.Tensor, Prepared | None]:
    """Launch the GEMM through Triton: (partials, each 64-row group's count of them, the launch
    prepared when ``keep``)."""
    m = xq.shape[0]
    np_, kp = qw.padded_shape
    if xq.shape[1] != input_columns(kp, cfg.halves):
        raise ValueError(f"x' has {xq.shape[1]} columns; this configuration (halves={cfg.halves}) reads "
                         f"{input_columns(kp, cfg.halves)}: build it with hadamard_input(..., halves={cfg.halves})")
    nkb = kp // BLOCK_K
    tiles, steps = tiles_and_steps((np_, kp), cfg.fragments)
    programs = min(cfg.programs, steps)
    counts = device_constant(("segments", programs, tiles, nkb, cfg.fragments), xq.device,
                             lambda: segment_counts(programs, tiles, nkb, cfg.fragments, xq.device))
    segs = _most_segments(programs, tiles, nkb)
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_tokens, BLOCK_K], x_smem_layout(cfg.block_tokens))
    mk = partial_rows(m, cfg.block_tokens)  # x' rows m..mk, where x' has them, else TMA's zeros
    ws = torch.empty((segs, mk, np_), dtype=torch.float32, device=xq.device)
    grid = (programs, triton.cdiv(m, cfg.block_tokens))
    args = (x_desc, packed.descs[cfg.fragments], ws, mk, np_, nkb, steps, programs)
    settings = dict(BITS=qw.bits, BN=cfg.block_tokens, STAGES=cfg.stages, FRAGS=cfg.fragments,
                    HALVES=cfg.halves, PDL=cfg.dependent_launch, num_warps=4,
                    launch_pdl=cfg.dependent_launch, maxnreg=cfg.max_registers)
    return ws, counts, prepare(_decode_wgmma_kernel, grid, *args, slots=("x_desc", "ws_ptr") if keep else None,
                             **settings)


# -- Why the configuration is what it is ---------------------------------------------------------
# Measured on one H200 (torch 2.11+cu130, triton 3.6.0), CUDA graphs, weights rotated over >= 4x
# L2, median of 3 rounds, bench_decode_wgmma.py (docs/KERNELS.md, "Even split").
# Fragments and stages (decode_wgmma_h200_sweep.*, then rule_refit_h200/variants_*): two fragments
# share each activation tile and halve the loop's overhead per weight up to 32 tokens; there one
# fragment a program at 4-8 programs an SM lost 4-89%, two capped at 96 registers (5 an SM)
# 2-12%. At 64 tokens two fragments take 205 registers (2 an SM); one fragment with a ring of 2
# holds 4 an SM and was 6-8% faster on four shapes (gate_up / down / 8B q/k/v / 8B down M=64:
# 48.6 / 30.2 / 19.5 / 35.7 µs against 51.8 / 32.4 / 21.3 / 38.2; capped at 168 registers, 3 an
# SM: 50.4 / 31.9 / 21.6 / 37.9). Token blocks of at most 128: the 256-token block holds one
# program an SM, decode and MMAs in series, and two blocks of 128 (each weight decoded twice)
# ran gate_up / down / 8B q/k/v / 8B down at 256 tokens in 123.3 / 67.7 / 41.4 / 85.2 µs against
# 186.2 / 101.6 / 71.3 / 122.4. Stages: 3 elsewhere.
# Codec (benchmarks/results/decode_next_ab, one process): at 8 tokens the halves codec with one
# fragment, 5 an SM, ran gate_up / down / 8B down in 33.5 / 20.3 / 24.1 µs at M=1 and 35.4 / 21.7
# / 25.7 at M=8, against the exact codec's two fragments 34.4 / 21.6 / 25.0 and 35.5 / 22.8 / 26.4
# (0.3-6% faster; with two fragments 2% faster). At 16-32 tokens it lost (gate_up M=16 38.2
# against 37.6, M=32 51.6 against 41.7): each step's second MMA and activation tile outweigh the
# integer work it saves (3.98 against 4.85 integer ops a weight at 8 tokens, offline census).
# K=3 at 8 tokens (benchmarks/results/k3_cap/h200_ad46a25/, bench_decode_wgmma --variants --bits 3,
# one process): the halves codec with one fragment at 5 an SM ran gate_up / down / 8B down in
# 36.2 / 22.0 / 26.0 us against the exact codec's two fragments (the rule before) 38.5 / 24.2 /
# 28.4: 6-9% faster, so it is the rule's at K=3 too. At 16 tokens it was level (38.7 / 25.5 / 29.6
# against 40.0 / 25.4 / 29.7) and the rule keeps the exact codec there.
# Grid: the kernel used to split each row tile's k-range into whole slices (tiles x split
# programs); ncu found the last, partial wave idle (gate_up M=8: 816 programs against 528 a wave,
# decode_wgmma_ncu_h200.txt), and an early start lost up to 1.6x on such grids. With the even
# split every program takes the same steps (benchmarks/results/even_split_h200/run1_*; µs, the
# programs as multiples of 132 SMs; "t6" = 6 whole-tile slices, the old grid):
#                     132     264     396     528     t6      the kernel before (eb165e9)
#   gate_up M=16      114.8   62.1    45.1    37.7    40.4    40.5
#   gate_up M=128     121.3   73.3    93.0    79.1    99.9    84.7     (264 = one wave there)
#   down    M=16      64.0    38.7    30.0    27.4    41.5    30.6
#   down 8B M=16      82.7    48.8    38.1    33.4    61.2    41.7
# One wave (PROGRAMS_PER_SM x SMs) was the fastest grid, or within 0.5% of it, at all 15 points of
# run 1 (gate_up, down, 8B down; M = 1, 8, 16, 64, 128); two waves lost 8% at gate_up M=128. Against
# the kernel before, the call was faster or equal everywhere but gate_up M=1 / 8 (35.9 / 36.6
# against 34.8 / 36.0) and down M=64 (44.4 against 43.0, started late). Start: with
# every SM busy to the end, the early start won at every point, also where it used to lose
# (down M=1 25.0 against 37.2 before; M=64 gate_up / down / 8B down 53.3 / 40.9 / 52.9 early
# against 55.5 / 44.4 / 56.0 late). Hence one wave, started early. benchmarks/fit_splitk.py
# --kernel decode-wgmma checks the grid over Qwen3-14B's projections at TP 1, 2, 4.
# Narrow weights (benchmarks/results/splitk_fill_h200/: 20 tensor-parallel shards of Qwen3-14B and
# Llama-3-8B, 1-64 tokens): the floor of two k-blocks a program leaves some grids short of a wave.
# Filling the wave (programs of one or two k-blocks) was 5.9-19.9% faster at all 13 points where
# the floor left under 2.12 programs an SM, and 0.1-7.2% slower at 15 of the 17 where it left
# 2.91-4.24 (uneven programs, more partials): hence FILL_PER_SM = 2.5. Started late, a grid was
# faster only under two programs an SM (Llama-3-8B's o at TP 4, 16-32 tokens: 256 programs, 8.2 /
# 9.1 against 8.6 / 9.9 us): hence LATE_PER_SM. Against the rule before, in one process: 5-24%
# faster at every point it changed, K = 2 and 3 (o at TP 4, 16 tokens: 9.1 against 10.9 us).
# Out of sample, at TP 8 (splitk_fill_h200/tp8_0153872/): faster, or within 2%, at 19 of 20 points;
# the late start lost 7-16% on Llama-3-8B's o (4096 x 512: four k-blocks) at 1-16 tokens.
# K=3 at 32 and 64 tokens (benchmarks/results/k3_cap/h200_d2fb6ec/, whole call, median of 3): the
# uncapped builds (137 and 165 registers, 3 programs an SM) started early took 51.9 / 60.2 µs on
# gate_up and 30.7 / 35.1 on down at 32 / 64 tokens (bf16 cuBLAS 45.2 / 47.6 and 28.2 / 28.9);
# capped at 128 registers (no spills) with 4 an SM, 43.3 / 48.7 and 27.8 / 30.0: 9-19% less.
# Started late the uncapped builds took 43.8 / 50.3 and 27.4 / 30.5 (the cap: -3% to +1.5% against
# those). The uncapped 64-token build's 10 us, started early, were its wave's, not its build's
# (benchmarks/results/waves_h200/): at M = 64 Triton's kernel for M a multiple of 16 takes 127
# registers (4 an SM), and a wave of 3 an SM started early loses 16-20% (gate_up / down 60.3 / 34.5
# us) where the full wave takes the rule's time (48.5 / 29.6); the rule's capped build loses the
# same on that wave (60.4 / 34.7). Capped at 168 (3 an SM, its wave its capacity) it took 49.3 /
# 29.2. Hence PROGRAMS_PER_SM is the capacity of every kernel a block's launches compile (tests).
# Three runs show the loss (loop_h200/, ws_loader/h200_cb854b2/, k3_cap/), each with the rule's
# arm timed second, after cuBLAS (docs/KERNELS.md). Hence REGISTER_CAPS: faster than every
# other arm timed of these builds but two (down: at 32 tokens started late, 1.5% ahead; at 64
# capped at 168, 2.7% ahead).
# K=2 at 16 tokens (benchmarks/results/caps_h200/, bench_decode_wgmma --cap-variants, two runs, one
# process each, µs, whole call): the two-fragment build capped at 128 registers (4 an SM, as
# uncapped) ran gate_up / down / 8B q/k/v / 8B down at 16 tokens in 35.4 / 22.6 / 15.4 / 26.1
# against 37.0 / 23.6 / 15.9 / 27.3 (3-4% less; run 1 the same on three shapes), and at 12
# tokens 35.8 / 22.8 / 15.3 / 26.3 against 36.0 / 22.9 / 15.4 / 26.4. Caps of 112-124 gained less.
# ncu at gate_up 16 tokens: the same occupancy, "wait" (fixed-latency dependency) stalls 0.73
# cycles an issued instruction against 1.36, GEMM 33.0 against 34.3 µs: a launch at M = 16 runs
# Triton's build for M a multiple of 16, whose uncapped loop ptxas schedules with 1504 stall cycles
# against 1144 capped (1196 / 1190 for other M; benchmarks/census_caps.py). At K=3 and 16 tokens the
# caps were level (39.8 / 25.0 / 28.9 against 39.6 / 24.8 / 28.8); at 64 tokens (K=2 and 3) caps
# keeping 4 an SM were level and 96 registers (5 an SM) 4.5-12% slower; at 32 tokens a ring of 2
# capped at 96 (84 registers, 5 an SM) within -2% to +2%. Not taken there.
# One fragment at every block, and the exact codec's sum by add.f16 (benchmarks/results/exact_hadd_h200/,
# 2026-12-04): once the pair codec took its first state by a shift (shift_state_h200/: the FMA pipe
# freed, 2-13% less at 1-64 tokens), summing each word's halves by add.f16 (HADD2, FMA pipe)
# instead of two prmt and add.f16x2 (ALU pipe) evened the pipes again, and one 64-row fragment a
# program (4 an SM at 16-64 tokens, 5 at 8) beat two at 16-32 tokens: against the rule before
# (11b05e7: two fragments to 32 tokens, the prmt sum), in one process, gate_up / down / 8B down /
# 8B q/k/v at 16 tokens 32.3 / 20.0 / 23.8 / 13.8 us against 34.1 / 21.8 / 25.0 / 14.9, at 32
# 35.3 / 22.3 / 26.4 / 15.1 against 38.6 / 25.0 / 28.6 / 16.8, at 64 40.2 / 25.7 / 30.2 / 16.7
# against 42.8 / 26.9 / 31.7 / 17.4, and within 1% at 1-8 tokens (the halves codec, unchanged);
# K=3 gate_up / down at 16, 32, 64 tokens 37.4 / 23.1, 39.6 / 24.6, 45.8 / 28.5 against 39.4 /
# 24.7, 43.0 / 27.4, 48.3 / 29.9. The sum costs registers: uncapped, K=2's 64-token build takes
# 167 at M not a multiple of 16 (3 an SM) and K=3's 16-token one 98 (4 an SM, its M-multiple-of-16
# build 96: 5), hence their caps of 128 and 96 (no spills). K=2's 16-token build holds 5 an SM
# uncapped (95 registers) but ran gate_up / down / 8B down in 33.0 / 20.7 / 24.4 us there (rule/)
# against 32.0 / 20.1 / 23.8 capped at 128 (4 an SM; first/), in two calls whose 11b05e7 arm
# agreed within 0.3 us: the cap stays (final/: 32.3 / 20.0 / 23.8). The fp8 decode
# GEMM kept the prmt sum then (its pair one f16x2 register for the mul by 64; the add.f16 form
# cost its 64-token build registers, a program an SM, for 1-2.5%); since its weights are 16 T from
# the codec (``_pair_values_x16``: no multiply) it sums by add.f16 too, its 64-token build capped
# at 128 registers (benchmarks/results/fp8_x16/).
# Partials' rows (``partial_rows``; benchmarks/results/partial_rows_h200/, one process against
# fe633fc, µs, whole call): with M rounded up to 16 every launch runs the build for M a multiple
# of 16; gate_up / down / 8B down at 24 tokens 34.9 / 21.9 / 26.3 against 35.5 / 22.2 / 26.7, at 56
# 40.3 / 25.6 / 30.3 against 42.0 / 26.2 / 31.4, at 40 44.1 / 24.8 / 31.5 against 44.4 / 25.8 /
# 30.6 (the one loss), level at 48. It does not mend 40 tokens: there the GEMM alone, in the same
# build on the same 48-row partials, took 40.0 us on gate_up against 34.9 at 48 tokens (35.8 at
# 56), so the build was not the cause; what differs is x' (40 rows, TMA zero-filling 24 of a
# 64-row box). Storing through an opaque move (as decode_fp8._store_rows) gives the two builds
# the same code and every block its programs an SM without a cap, but was 1-4% slower at 1, 16
# and 64 tokens and level at 40 (benchmarks/results/opaque_store_h200/): not taken. x' with the
# rounded rows too (``prepare_input(..., rows=)``; benchmarks/results/x16_xpad_h200/, one process
# against c25f908): gate_up / down / 8B down at 40 tokens 39.1 / 24.7 / 29.4 against 44.4 / 25.1 /
# 29.6, at 24, 48 and 56 within 0.5%: a TMA box reaching 24 rows past x' was the 40-token loss.

