"""Decode GEMM for Hopper: the trellis decoded straight into wgmma's register A operand.

    z^T [64 weight rows, tokens] += T_blk [64, 128] @ x'^T [128, tokens]     (one warpgroup)

Swap AB as in the portable kernel (decode.py): weight rows fill the wgmma M dimension (64 per
warpgroup), tokens its N dimension (8..256), the activations x' come from shared memory (TMA,
a ring of STAGES buffers). Unlike the portable kernel, the decoded weights never leave the
registers: every thread decodes exactly the fp16 values of its own A fragment and the
``wgmma.mma_async`` reads them from registers.

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

Words are repacked once per weight (``pack_words``: 64 bits per tile row, 2x the trellis at
K = 2, 1.33x at K = 3) so that a thread's words are two 16-byte loads, fetched one loop step
ahead of their use.

Codec variants (``halves``). Exact: two prmt and one add.f16x2 per pair of weights assemble
the fp16 values T = fp16(lo + hi) of docs/FORMAT.md. Halves: the two fp16 halves lo, hi of each
weight's masked LCG word are themselves the register pair of two MMA columns, both multiplied by
the same activation (x' is stored twice), so the tensor core forms lo x + hi x exactly in fp32:
the effective weight is the unrounded sum lo + hi, within half an fp16 ulp of T (docs/KERNELS.md,
tolerance table). It removes 3 of 10 codec instructions per weight pair, at twice the MMA work,
so it pays where the tensor cores idle (few tokens).

Epilogue: the warpgroup applies H64 to its 64 rows of z (a wgmma with the +-1 matrix as the
register A operand and z, split into three bf16 pieces, as B), and writes fp32 partials
P = H64 z [split, M, Np]. ``_combine_kernel`` then sums the partials in the fixed order
s = 0..split-1 and finishes the 128-point transform with the top-level butterfly
(H128 = [[H64, H64], [H64, -H64]] in Sylvester order) and the row scales: no atomics, bitwise
reproducible results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                               warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..format.bitstream import words_to_u64
from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK, TILE, words_per_tile
from .codec import round_to
from .splitk import decode_split_k
from .transforms import hadamard_input, row_scale_block

ROWS = 64  # weight rows per program: one wgmma A fragment
BLOCK_K = HAD_BLOCK  # k per loop step: one Hadamard block, 8 tiles
STEP_WORDS = ROWS * BLOCK_K // 8  # 64-bit row windows: 2 words per 16 weights -> 1024
MAX_TOKENS = 256  # wgmma N
SUPPORTED_BITS = (2, 3)  # the row window holds every state of a row for K <= 3
# A step's words as TMA moves them: [8, 128] int32, unswizzled (each thread reads 16-byte runs).
WORDS_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def x_smem_layout(block_tokens: int) -> gl.NVMMASharedLayout:
    """Shared layout of an activation tile [block_tokens, 128] fp16 (wgmma's B operand, K-major;
    a step of the halves codec reads two, the x' columns being stored twice)."""
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
    """The weight's words in the kernel's load order: int32 [Np/64, Kp/128, 1024].

    Within a (64-row block, 128-column block) the 1024 words are ordered
    [warp w (4), row half mh (2), lane 4g + t (32), tile half h (2), hi/lo (2)]: lane (g, t) of
    warp w holds the windows of tile rows g + 8 mh of the 16-row tile 4 nb + w, in tiles
    2t + h of the column block, so each thread's words are two aligned 16-byte loads and each
    load instruction of a warp reads 512 contiguous bytes.
    """
    if qw.bits not in SUPPORTED_BITS:
        raise ValueError(f"the register-operand decode handles K in {SUPPORTED_BITS}, got K={qw.bits}")
    v = row_windows(qw.trellis, qw.bits)  # [TN, TK, 16, 2]
    tn, tk = v.shape[:2]
    # tn = 4 nb + w; tk = 8 kb + 2 t + h; row = 8 mh + g
    v = v.reshape(tn // 4, 4, tk // 8, 4, 2, 2, 8, 2)  # nb, w, kb, t, h, mh, g, j
    v = v.permute(0, 2, 1, 5, 6, 3, 4, 7)  # nb, kb, w, mh, g, t, h, j
    return v.reshape(tn // 4, tk // 8, STEP_WORDS).contiguous()


def mma_column_order(halves: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64: the T column (within a 128-block) that each MMA column of a step multiplies.

    Exact codec, [128]: MMA column 16 s + 8 h + 2 t + e holds T column 16 (2t + h) + s + 8 e.
    Halves codec, [256]: MMA columns 2 j and 2 j + 1 (j = 8 s + 4 h + t) hold the low and high
    half of T column 16 (2t + h) + s. Either way lane t owns all 16 columns of tiles 2t, 2t + 1.
    """
    if halves:
        kk = torch.arange(2 * BLOCK_K, device=device)
        j = kk // 2
        s, h, t = j // 8, (j // 4) % 2, j % 4
        return 16 * (2 * t + h) + s
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


# The codec's asm blocks return f16x2 pairs as uint32: a decoded step is carried across the loop
# as 32-bit registers (an fp16 tensor would travel as 16-bit halves that ptxas re-pairs with
# prmt), and ``_operand`` reinterprets it as the A fragment right before the wgmma.

@gluon.jit
def _pair_values(t):
    """3INST values of columns c and c + 8 of a K=2 tile row as one f16x2, t = funnel(hi, lo, 2c).

    t's high half is the state of column c and its low half the state of column c + 8. The
    second state's LCG value is derived with mads on the FMA pipe instead of extracting it:
    t*MUL + ADD*(1 + 2**16) - (x_a << 16) = s_b*MUL + ADD (mod 2**32). The first state is
    mul.hi(t, 2**16) (FMA pipe too). Then the mask/xor (lop3), two prmt that gather the low and
    the high halves of both values, and one add.f16x2.
    """
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 sa, xa, xb, lo, hi;
        mul.hi.u32 sa, $1, 65536;
        mad.lo.u32 xa, sa, 89226354, 64248484;
        mad.lo.u32 xb, $1, 89226354, 1584945828;
        mad.lo.u32 xb, xa, 0xFFFF0000, xb;
        lop3.b32 xa, xa, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        lop3.b32 xb, xb, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        prmt.b32 lo, xa, xb, 0x5410;
        prmt.b32 hi, xa, xb, 0x7632;
        add.rn.f16x2 $0, lo, hi;
        }""",
        "=r,r", [t], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _pair_halves(t):
    """``_pair_values`` without the final assembly: the masked LCG words of columns c and c + 8
    (each an f16x2 (low, high) whose sum is the weight: the halves codec)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 sa;
        mul.hi.u32 sa, $2, 65536;
        mad.lo.u32 $0, sa, 89226354, 64248484;
        mad.lo.u32 $1, $2, 89226354, 1584945828;
        mad.lo.u32 $1, $0, 0xFFFF0000, $1;
        lop3.b32 $0, $0, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        lop3.b32 $1, $1, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        }""",
        "=&r,=&r,r", [t], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def _state_values(sa, sb):
    """3INST values of two states as one f16x2 (mad, lop3 each; prmt, prmt, add.f16x2)."""
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 xa, xb, lo, hi;
        mad.lo.u32 xa, $1, 89226354, 64248484;
        mad.lo.u32 xb, $2, 89226354, 64248484;
        lop3.b32 xa, xa, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        lop3.b32 xb, xb, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        prmt.b32 lo, xa, xb, 0x5410;
        prmt.b32 hi, xa, xb, 0x7632;
        add.rn.f16x2 $0, lo, hi;
        }""",
        "=r,r,r", [sa, sb], dtype=gl.uint32, is_pure=True, pack=1)


@gluon.jit
def _state_halves(sa, sb):
    """``_state_values`` without the assembly: both masked LCG words."""
    return gl.inline_asm_elementwise(
        """{
        mad.lo.u32 $0, $2, 89226354, 64248484;
        mad.lo.u32 $1, $3, 89226354, 64248484;
        lop3.b32 $0, $0, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        lop3.b32 $1, $1, 0x8FFF8FFF, 0x3B603B60, 0x6A;
        }""",
        "=&r,=&r,r,r", [sa, sb], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.constexpr_function
def _fragment_layout():
    """The A fragment [64, 128] as a blocked layout over [warp, row half, g, s, h, t, e]: MMA row
    16 warp + 8 half + g, MMA column 16 s + 8 h + 2 t + e. Registers run e, row half, h, s as in
    wgmma's A operand (k_width 2), lanes t then g, warps over rows: reshaped to [64, 128] it is
    exactly DotOperandLayout (checked by convert_layout's assert_trivial)."""
    return gl.BlockedLayout(size_per_thread=[1, 2, 1, 8, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 1, 4, 1],
                            warps_per_cta=[4, 1, 1, 1, 1, 1, 1], order=[6, 1, 4, 3, 5, 2, 0])


@gluon.jit
def _decode_step(w, BITS: gl.constexpr, HALVES: gl.constexpr):
    """Decode one step's words ``w`` ([4, 2, 8, 2, 4, 2]: warp, row half, g, tile half, t,
    hi/lo; see pack_words) into f16x2 words over [warp, row half, g, c, h, t] (c in 0..7):
    exact, one tensor of (column c, column c + 8) values; halves, two tensors (columns c and
    c + 8) of (low, high) halves."""
    WC: gl.constexpr = gl.SliceLayout(6, _fragment_layout())
    W5: gl.constexpr = gl.SliceLayout(3, WC)
    hi, lo = gl.split(w)
    hi = gl.expand_dims(gl.convert_layout(hi, W5), 3).to(gl.uint32, bitcast=True)
    lo = gl.expand_dims(gl.convert_layout(lo, W5), 3).to(gl.uint32, bitcast=True)
    v = (hi.to(gl.uint64) << 32) | lo.to(gl.uint64)  # [4, 2, 8, 1, 2, 4]
    c = _iota(8, 3, 6, WC).to(gl.uint64)  # columns c and c + 8
    if BITS == 2:
        t = ((v << (2 * c)) >> 32).to(gl.uint32)  # funnel: states of columns c (high half) and c + 8
        if HALVES:
            out = _pair_halves(t)
        else:
            out = _pair_values(t)
    else:
        sa = ((v >> (48 - BITS * c)) & 0xFFFF).to(gl.uint32)
        sb = ((v >> (48 - BITS * (c + 8))) & 0xFFFF).to(gl.uint32)
        if HALVES:
            out = _state_halves(sa, sb)
        else:
            out = _state_values(sa, sb)
    return out


@gluon.jit
def _operand(u, A_LAYOUT: gl.constexpr):
    """The [64, 128] fp16 A fragment held by the f16x2 words ``u`` of ``_decode_step`` (a register
    reinterpretation: the asm is a move that ptxas removes)."""
    h = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [gl.join(u, u)], dtype=gl.float16, is_pure=True,
                                  pack=2)
    return gl.convert_layout(gl.reshape(h, [64, 128]), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _load_step_words(w_smem, stage):
    """A step's words from the TMA ring: [8, 128] (warp * 2 + row half, (g, t, tile half, hi/lo))
    viewed as [warp, row half, g, tile half, t, hi/lo]."""
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[4, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])
    return w_smem.index(stage).reshape([4, 2, 8, 4, 2, 2]).permute([0, 1, 2, 4, 3, 5]).load(WL)


@gluon.jit
def _hadamard64(z, z_smem, MMA: gl.constexpr):
    """H64 z for the accumulator z [64, BN] (fp32, MMA layout): a wgmma with the exact +-1 matrix
    as register A operand and z as three bf16 pieces (z = z1 + z2 + z3 to 24 bits) in shared
    memory, accumulated in fp32. z_smem is [BN, 64], K-major like the activation tiles."""
    HA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    i = gl.arange(0, 64, layout=gl.SliceLayout(1, HA))[:, None]
    j = gl.arange(0, 64, layout=gl.SliceLayout(0, HA))[None, :]
    a = i & j
    a = a ^ (a >> 4)
    a = a ^ (a >> 2)
    a = a ^ (a >> 1)
    h = (1 - 2 * (a & 1)).to(gl.bfloat16)
    p = gl.zeros(z.shape, dtype=gl.float32, layout=MMA)
    r = z
    for _ in gl.static_range(3):
        piece = r.to(gl.bfloat16)
        r = r - piece.to(gl.float32)
        z_smem.store(gl.permute(piece, (1, 0)))
        fence_async_shared()
        gl.thread_barrier()
        p = warpgroup_mma(h, z_smem.permute((1, 0)), p)
    return p


@gluon.jit
def _decode_wgmma_kernel(x_desc, w_desc, ws_ptr, M, Np, NKB, KB_PER_SPLIT,
                         BITS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, HALVES: gl.constexpr):
    """Program (64-row block, split slice, token block): P = H64 z^T over its k-blocks.

    Each step's activation tiles x' [BN, 128] (two for the halves codec) and word block [8, 128]
    arrive by TMA on one
    mbarrier, STAGES steps ahead of their use, so the loop never waits on global memory. The
    next step's fragment is decoded while the current step's MMAs run.
    """
    nb = gl.program_id(0)
    sl = gl.program_id(1)
    tb = gl.program_id(2)
    kb0 = sl * KB_PER_SPLIT
    n = gl.minimum(NKB - kb0, KB_PER_SPLIT)
    NX: gl.constexpr = 1 + HALVES  # activation tiles [BN, 128] per step

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)

    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES * NX, BN, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 8, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    row0 = tb * BN
    wrow0 = (nb * NKB + kb0) * 8
    nbytes: gl.constexpr = NX * x_desc.block_type.nbytes + w_desc.block_type.nbytes
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n)
        for h in gl.static_range(NX):
            tma.async_copy_global_to_shared(x_desc, [row0, ((kb0 + i) * NX + h) * 128], bars.index(i),
                                            x_smem.index(i * NX + h), pred=i < n)
        tma.async_copy_global_to_shared(w_desc, [wrow0 + i * 8, 0], bars.index(i), w_smem.index(i), pred=i < n)

    acc = gl.zeros([64, BN], dtype=gl.float32, layout=MMA)
    mbarrier.wait(bars.index(0), 0)
    u = _decode_step(_load_step_words(w_smem, 0), BITS, HALVES)
    for i in range(n):
        stage = i % STAGES
        if HALVES:
            a0 = _operand(u[0], A_LAYOUT)
            a1 = _operand(u[1], A_LAYOUT)
            acc = warpgroup_mma(a0, x_smem.index(2 * stage).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a1, x_smem.index(2 * stage + 1).permute((1, 0)), acc, is_async=True)
        else:
            a0 = _operand(u, A_LAYOUT)
            acc = warpgroup_mma(a0, x_smem.index(stage).permute((1, 0)), acc, is_async=True)
        # Decode the next step while this step's MMAs run.
        u_next = u
        if i + 1 < n:
            nxt = (i + 1) % STAGES
            mbarrier.wait(bars.index(nxt), ((i + 1) // STAGES) & 1)
            u_next = _decode_step(_load_step_words(w_smem, nxt), BITS, HALVES)
        if HALVES:
            acc, a0, a1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0, a1))
        else:
            acc, a0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a0))
        # Refill the stage this step read (its MMAs have completed) with the step STAGES ahead.
        j = i + STAGES
        mbarrier.expect(bars.index(stage), nbytes, pred=j < n)
        for h in gl.static_range(NX):
            tma.async_copy_global_to_shared(x_desc, [row0, ((kb0 + j) * NX + h) * 128], bars.index(stage),
                                            x_smem.index(stage * NX + h), pred=j < n)
        tma.async_copy_global_to_shared(w_desc, [wrow0 + j * 8, 0], bars.index(stage), w_smem.index(stage), pred=j < n)
        u = u_next

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    z_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, 64], gl.NVMMASharedLayout.get_default_for([BN, 64], gl.bfloat16))
    p = _hadamard64(acc, z_smem, MMA)
    rows = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    tok = row0 + gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    ptrs = ws_ptr + (sl * M + tok[None, :]).to(gl.int64) * Np + rows[:, None]
    gl.store(ptrs, p, mask=tok[None, :] < M)


@triton.jit
def _combine_kernel(ws_ptr, y_ptr, scale_ptr, su_ptr, gscale_ptr, inv_ptr, M, N_out, Np, stride_ym,
                    SPLIT: tl.constexpr, BM: tl.constexpr):
    """y for Hadamard block pid 0 and token block pid 1 from the partials P_s = H64 z_s of its
    two 64-row halves a, b: y_top = (sum_s P_a + sum_s P_b) r / sqrt(128) 2**-e,
    y_bottom = (sum_s P_a - sum_s P_b) r / sqrt(128) 2**-e, sums in the fixed order s = 0, 1, ..."""
    blk = tl.program_id(0)
    mb = tl.program_id(1)
    m = mb * BM + tl.arange(0, BM)[:, None]
    i = tl.arange(0, 64)[None, :]
    na = blk * 128 + i
    mmask = m < M
    pa = tl.zeros([BM, 64], dtype=tl.float32)
    pb = tl.zeros([BM, 64], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        base = ws_ptr + (s * M + m).to(tl.int64) * Np + na
        pa += tl.load(base, mask=mmask, other=0.0)
        pb += tl.load(base + 64, mask=mmask, other=0.0)
    inv = tl.load(inv_ptr + m, mask=mmask, other=0.0) * 0.08838834764831845
    for half in tl.static_range(2):
        n = na + 64 * half
        y = (pa + pb) if half == 0 else (pa - pb)
        y = y * row_scale_block(scale_ptr, su_ptr, gscale_ptr, n, n < N_out) * inv
        tl.store(y_ptr + m * stride_ym + n, round_to(y, y_ptr.dtype.element_ty), mask=mmask & (n < N_out))


@gluon.jit
def _fragment_kernel(words_ptr, out_ptr, NKB, BITS: gl.constexpr, HALVES: gl.constexpr):
    """Test kernel: the weights the GEMM's A fragment holds for (64-row block, k block) = program
    id, at T[64 nb + row, 128 kb + weight] in the fragment's order (mma_column_order; with the
    halves codec, each weight as fp16(lo + hi)), for a bit-for-bit comparison with the reference."""
    nb = gl.program_id(0)
    kb = gl.program_id(1)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 16])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[4, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])
    off = (((_iota(4, 0, 6, WL) * 2 + _iota(2, 1, 6, WL)) * 32 + _iota(8, 2, 6, WL) * 4 + _iota(4, 4, 6, WL)) * 4
           + _iota(2, 3, 6, WL) * 2 + _iota(2, 5, 6, WL))
    w = gl.load(words_ptr + (nb * NKB + kb).to(gl.int64) * 1024 + off)
    u = _decode_step(w, BITS, HALVES)
    if HALVES:
        # Each weight as fp16(low + high): columns c (u[0]) and c + 8 (u[1]) of each pair.
        la, ha = gl.split(gl.reshape(_operand(u[0], A_LAYOUT), [64, 64, 2]))
        lb, hb = gl.split(gl.reshape(_operand(u[1], A_LAYOUT), [64, 64, 2]))
        a = gl.reshape(gl.permute(gl.join(la + ha, lb + hb), (0, 2, 1)), [64, 128])
    else:
        a = _operand(u, A_LAYOUT)
    OL: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    a = gl.convert_layout(a, OL)
    rows = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, OL))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, OL))
    gl.store(out_ptr + rows[:, None].to(gl.int64) * (NKB * 128) + cols[None, :], a)


def decoded_fragments(qw: QuantizedWeight, halves: bool = False, words: torch.Tensor | None = None) -> torch.Tensor:
    """fp16 [Np, Kp]: the weight core T as the GEMM's A fragments hold it (fragment order in each
    128-block). Equal bit for bit to ``mma_order_core(decode_trellis(qw), halves)`` (tests)."""
    np_, kp = qw.padded_shape
    words = pack_words(qw) if words is None else words
    out = torch.empty((np_, kp), dtype=torch.float16, device=qw.device)
    _fragment_kernel[(np_ // ROWS, kp // BLOCK_K)](words, out, kp // BLOCK_K, BITS=qw.bits, HALVES=halves,
                                                   num_warps=4)
    return out


def mma_order_core(t: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """The core T [Np, Kp] with each 128-column block in the A fragments' weight order."""
    kp = t.shape[1]
    order = mma_column_order(halves, t.device)[:: 1 + halves]
    idx = (torch.arange(kp // BLOCK_K, device=t.device)[:, None] * BLOCK_K + order[None, :]).reshape(-1)
    return t[:, idx]


# -- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeWgmmaConfig:
    """Launch parameters of the register-operand decode GEMM (see ``decode_wgmma_config``)."""

    block_tokens: int  # wgmma N: tokens per program (power of two, 8..256)
    split: int  # k-slices (fp32 partials reduced in fixed order)
    stages: int  # steps in the TMA ring
    halves: bool  # codec variant (module docstring)


def decode_wgmma_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DecodeWgmmaConfig:
    """The rule: tokens padded to a power of two >= 8 (at most 256 per program); the halves codec
    up to 64 tokens, where the tensor cores have room for twice the MMAs; the fitted split-K rule;
    a ring 3 deep where shared memory allows (2 at 256 tokens)."""
    if m < 1:
        raise ValueError(f"need at least one token, got {m}")
    np_, kp = qw.padded_shape
    block_tokens = min(MAX_TOKENS, max(8, triton.next_power_of_2(m)))
    split = decode_split_k(np_ // HAD_BLOCK, kp // TILE)
    stages = 3 if block_tokens <= 128 else 2
    return DecodeWgmmaConfig(block_tokens=block_tokens, split=split, stages=stages, halves=block_tokens <= 64)


def decode_wgmma(x: torch.Tensor, qw: QuantizedWeight, *, config: DecodeWgmmaConfig | None = None,
                 words: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T on a Hopper GPU, in x's dtype.

    ``words`` is ``pack_words(qw)`` (computed here when not given; callers that multiply the
    same weight repeatedly keep it).
    """
    if qw.bits not in SUPPORTED_BITS or qw.codebook_id != 0:
        raise ValueError(f"the register-operand decode handles 3INST at K in {SUPPORTED_BITS}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be fp16, bf16 or fp32, got {x.dtype}")
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x has inner dimension {x.shape[-1]}, the weight expects {qw.in_features}")
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or decode_wgmma_config(qw, m, x.device)
    np_, kp = qw.padded_shape
    nkb = kp // BLOCK_K
    if words is None:
        words = pack_words(qw)
    xq, inv = hadamard_input(x2d, qw, mma_order=True, halves=cfg.halves)
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_tokens, BLOCK_K], x_smem_layout(cfg.block_tokens))
    w_desc = TensorDescriptor.from_tensor(words.view(-1, BLOCK_K), [8, BLOCK_K], WORDS_SMEM_LAYOUT)
    kb_per = triton.cdiv(nkb, min(cfg.split, nkb))
    split = triton.cdiv(nkb, kb_per)
    ws = torch.empty((split, m, np_), dtype=torch.float32, device=x.device)
    y = torch.empty((m, qw.out_features), dtype=x.dtype, device=x.device)
    grid = (np_ // ROWS, split, triton.cdiv(m, cfg.block_tokens))
    _decode_wgmma_kernel[grid](x_desc, w_desc, ws, m, np_, nkb, kb_per, BITS=qw.bits, BN=cfg.block_tokens,
                               STAGES=cfg.stages, HALVES=cfg.halves, num_warps=4)
    bm = min(64, triton.next_power_of_2(m))
    _combine_kernel[(np_ // HAD_BLOCK, triton.cdiv(m, bm))](ws, y, qw.scale, qw.su, qw.gscale, inv, m,
                                                           qw.out_features, np_, y.stride(0), SPLIT=split,
                                                           BM=bm, num_warps=4)
    return y.reshape(*x.shape[:-1], qw.out_features)
