"""Decode GEMM on the fp8 tensor cores (Hopper): the trellis decoded into an e4m3 register A operand.

    z^T [64 weight rows, tokens] += e4m3(64 T_blk) [64, 128] @ x'_q^T [128, tokens]   (one warpgroup)

The register-operand decode kernel (``decode_wgmma``) with fp8 operands: the same words
(``pack_words``), the same even split of (row tile, k-block) steps over one wave of programs, the
same TMA ring and fp32 partials for ``transforms.hadamard_output``; but each decoded weight is
scaled by 64 and rounded to e4m3 (as the dequantize-once core, ``dequant.dequantize_core``:
|64 T| < 256, a power of two, no saturation), and the activations are e4m3 (the input transform's
``fp8`` form: x' times a power of two per token, |x' 2**e| <= 2**8), so each step is ``wgmma ... m64nNk32 .e4m3.e4m3`` with A in registers: half
the tensor-core time and half the activation bytes of the fp16 kernel, at the fp8 paths' accuracy
(docs/KERNELS.md, Prefill, "Accuracy"). Meant for the token counts where the fp16 kernel's MMAs
cost as much as its decode (128 and more).

Layout. The A fragment of m64nNk32 (8-bit types) gives a thread of warp w, lane 4g + t the rows
{16w + g, 16w + g + 8} and, in each 32-wide k step s, the columns {32 s + 4 t + e', 32 s + 16 +
4 t + e'}, e' = 0..3, one 32-bit register each. The MMA's k order inside a 128-block is ours
(``transforms.prepare_input(..., fp8=True)`` stores x' the same way), chosen so that a thread again owns
tiles 2t and 2t + 1 of the block, whose row windows are the fp16 kernel's words:

    MMA column kk = 32 s + 16 h + 4 t + 2 u + e   holds   T column 16 (2t + u) + (2 s + h) + 8 e

so a register's four bytes are columns c and c + 8 (c = 2 s + h) of tiles 2t and 2t + 1: at K=2
each pair is one funnel shift (``decode_wgmma._pair_values``), then one mul.f16x2 by 64 and one
cvt.rn.satfinite.e4m3x2.f16x2.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..format.codec import decode_trellis
from ..format.qweight import QuantizedWeight
from .common import (
    FP8_DTYPE,
    check_codebook,
    check_operands,
    dependent_launch_supported,
    device_constant,
    output_tensor,
    prepare,
)
from .decode_wgmma import (
    _RELEASE_ASM,
    _WAIT_ASM,
    BLOCK_K,
    FRAGMENT_ROWS,
    HOPPER_SMS,
    SUPPORTED_BITS,
    WORDS_LAYOUT,
    WORDS_SMEM_LAYOUT,
    _fragment_words,
    _grid_dependency,
    _iota,
    _most_segments,
    _next_step,
    _packed,
    _pair_values,
    _state_values,
    _store_partials,
    _word_row,
    permute_blocks,
    runs_on,
    segment_counts,
)
from .transforms import hadamard_output, prepare_input
from .triton_compat import tma_async_load

MAX_TOKENS = 256  # wgmma N: tokens per program at most


@functools.cache
def x_smem_layout(block_tokens: int) -> gl.NVMMASharedLayout:
    """Shared layout of an activation tile [block_tokens, 128] e4m3 (wgmma's B operand, K-major)."""
    return gl.NVMMASharedLayout.get_default_for([block_tokens, BLOCK_K], gl.float8e4nv)


def fp8_mma_column_order(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [128]: the T column (within a 128-block) that MMA column kk multiplies."""
    kk = torch.arange(BLOCK_K, device=device)
    s, h, t, u, e = kk // 32, (kk // 16) % 2, (kk // 4) % 4, (kk // 2) % 2, kk % 2
    return 16 * (2 * t + u) + 2 * s + h + 8 * e


# -- device code ------------------------------------------------------------------------------

# A fragment's e4m3 weights as decoded: [warp, row half, g, s, h, u, t, e] (MMA row 16 warp + 8
# half + g; MMA column 32 s + 16 h + 4 t + 2 u + e once t and u trade places), registers ordered as
# the k_width=4 A operand holds them: e and u (four bytes), row half, h, s.
FP8_FRAGMENT_LAYOUT = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 2, 1, 4, 2, 2, 1, 2],
                                                    threads_per_warp=[1, 1, 8, 1, 1, 1, 4, 1],
                                                    warps_per_cta=[4, 1, 1, 1, 1, 1, 1, 1],
                                                    order=[7, 5, 1, 4, 3, 6, 2, 0]))


@gluon.jit
def _decode_fp8_fragment(w, BITS: gl.constexpr, L8: gl.constexpr, A_LAYOUT: gl.constexpr):
    """The [64, 128] e4m3 A operand e4m3(64 T) (fp8 MMA column order) from a fragment's words."""
    return gl.convert_layout(_decoded_fp8(w, BITS, L8, 64), A_LAYOUT, assert_trivial=True)


@gluon.jit
def _decoded_fp8(w, BITS: gl.constexpr, L8: gl.constexpr, ROWS: gl.constexpr):
    """e4m3(64 T) [ROWS, 128] (fp8 MMA column order) from the words of ROWS / 16 warps, in the
    registers the decode leaves it (L8 permuted)."""
    W7: gl.constexpr = gl.SliceLayout(7, L8)
    W5: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, W7))
    hi, lo = gl.split(w)  # [warp, row half, g, u, t]
    hi = gl.expand_dims(gl.expand_dims(gl.convert_layout(hi, W5), 3), 4).to(gl.uint32, bitcast=True)
    lo = gl.expand_dims(gl.expand_dims(gl.convert_layout(lo, W5), 3), 4).to(gl.uint32, bitcast=True)
    v = (hi.to(gl.uint64) << 32) | lo.to(gl.uint64)  # [4, 2, 8, 1, 1, 2, 4] row windows
    c = (2 * _iota(4, 3, 7, W7) + _iota(2, 4, 7, W7)).to(gl.uint64)  # tile column c = 2 s + h
    if BITS == 2:
        va, vb = _pair_values(((v << (2 * c)) >> 32).to(gl.uint32))
    else:
        va, vb = _state_values(((v >> (48 - BITS * c)) & 0xFFFF).to(gl.uint32),
                               ((v >> (48 - BITS * (c + 8))) & 0xFFFF).to(gl.uint32))
    a = (gl.join(va, vb) * 64.0).to(gl.float8e4nv)  # 64 T: exact in fp16; e4m3 rounds to nearest even
    return gl.reshape(gl.permute(a, [0, 1, 2, 3, 4, 6, 5, 7]), [ROWS, 128])


@gluon.jit
def _decode_fp8_kernel(x_desc, w_desc, ws_ptr, M, Np, NKB, STEPS, PROGRAMS,
                       BITS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
    """Program (p, token block): steps [p STEPS / PROGRAMS, (p + 1) STEPS / PROGRAMS) of the
    token block's row tiles x NKB k-blocks (a tile is one 64-row fragment: two spilled), each
    z^T[64 rows, BN tokens] += e4m3(64 T_blk) x'_q^T, written as fp32 partials
    [segments, M, Np] (``decode_wgmma._decode_wgmma_kernel``'s split, ring and output). With PDL
    it fetches its first words while the input transform runs, then waits for x', and releases
    the output transform after its loop."""
    p = gl.program_id(0)
    tb = gl.program_id(1)
    s0 = ((p.to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32)
    n = (((p + 1).to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32) - s0

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    L8: gl.constexpr = FP8_FRAGMENT_LAYOUT
    WL: gl.constexpr = WORDS_LAYOUT

    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], x_desc.layout)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 8, 128], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    row0 = tb * BN
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    tile = s0 // NKB
    kb = s0 - tile * NKB
    t_in = tile
    kb_in = kb
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n)
        tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, 1), 0], bars.index(i), w_smem.index(i), pred=i < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)
    if PDL:
        _grid_dependency(_WAIT_ASM)
    t_x = tile  # the activations' k-blocks follow the words' (the tile is not needed)
    kb_x = kb
    for i in gl.static_range(STAGES):
        tma_async_load(x_desc, [row0, kb_x * 128], bars.index(i), x_smem.index(i), pred=i < n)
        t_x, kb_x = _next_step(t_x, kb_x, NKB)

    acc0 = gl.zeros([64, BN], dtype=gl.float32, layout=MMA)
    stage = 0
    phase = 0
    for i in range(n):
        carry = (kb != 0) & (i != 0)  # false at the first step of this program's part of the tile
        xs = x_smem.index(stage).permute((1, 0))
        mbarrier.wait(bars.index(stage), phase)
        # Nothing runs between the wgmma's issue and its wait: the wait cannot take 8-bit operands
        # as dependencies (triton 3.6: "Unexpected bitwidth in WGMMAWaitGroupOp"), so no register
        # of the A operand may be live-and-free while the wgmma reads it.
        a0 = _decode_fp8_fragment(_fragment_words(w_smem, stage, WL), BITS, L8, A_LAYOUT)
        acc0 = warpgroup_mma(a0, xs, acc0, use_acc=carry, is_async=True)
        acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0,))
        # Refill the stage this step read (its MMAs have completed) with the step STAGES ahead.
        j = i + STAGES
        mbarrier.expect(bars.index(stage), nbytes, pred=j < n)
        tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, 1), 0], bars.index(stage), w_smem.index(stage),
                       pred=j < n)
        tma_async_load(x_desc, [row0, kb_in * 128], bars.index(stage), x_smem.index(stage), pred=j < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)
        if (kb == NKB - 1) | (i == n - 1):  # the program's part of this tile ends here: store it
            _store_partials(ws_ptr, acc0, acc0, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN, 1, MMA)
        tile, kb = _next_step(tile, kb, NKB)
        stage += 1
        phase ^= (stage == STAGES).to(gl.int32)
        stage = gl.where(stage == STAGES, 0, stage)
    if PDL:
        _grid_dependency(_RELEASE_ASM)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _store_rows(ws_ptr, acc, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN: gl.constexpr, ROWS: gl.constexpr,
                MMA: gl.constexpr):
    """Program p's part of row tile ``tile`` (ROWS rows, accumulator [ROWS, BN] in layout MMA) as
    its segment of the fp32 partials [segments, M, Np] (``decode_wgmma._store_partials``)."""
    seg = p - (((tile * NKB + 1).to(gl.int64) * PROGRAMS + STEPS - 1) // STEPS).to(gl.int32) + 1
    # Np through an opaque move: offsets computed here, not hoisted out of the loop into registers
    # held across it (one a stored element).
    Np, M = gl.inline_asm_elementwise("mov.b32 $0, $2; mov.b32 $1, $3;", "=r,=r,r,r", [Np, M],
                                      dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
    tok = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
    rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
    base = ws_ptr + (seg * M + row0).to(gl.int64) * Np
    gl.store(base + tok[None, :] * Np + rows[:, None], acc, mask=tok[None, :] < M - row0)


@gluon.jit
def _decode_fp8_staged_kernel(x_desc, w_desc, ws_ptr, M, Np, NKB, STEPS, PROGRAMS,
                              BITS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, WM: gl.constexpr,
                              WN: gl.constexpr, A_SMEM: gl.constexpr, PDL: gl.constexpr):
    """As ``_decode_fp8_kernel`` with row tiles of 16 WM rows and WM x WN warps, whose decoded
    e4m3 weights go to shared memory (two buffers); the wgmma reads both operands from there,
    asynchronously, so step i's decode runs while step i - 1's MMAs do. Warps split the tile's
    rows (WM) and its tokens (WN: each warpgroup's MMA takes BN / WN of them); every warp decodes
    16 WM / (WM WN) rows of the tile."""
    p = gl.program_id(0)
    tb = gl.program_id(1)
    s0 = ((p.to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32)
    n = (((p + 1).to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32) - s0
    NW: gl.constexpr = WM * WN
    ROWS: gl.constexpr = 16 * WM
    FRAGS: gl.constexpr = WM // 4
    R2: gl.constexpr = 2 // WN  # 8-row groups a warp decodes

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                  instr_shape=[16, BN // WN, 32])
    L8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 4, 2, 2, 1, 2],
                                        threads_per_warp=[1, 1, 8, 1, 1, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1, 1, 1], order=[7, 5, 1, 4, 3, 6, 2, 0])
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])

    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], x_desc.layout)
    w_box = gl.allocate_shared_memory(gl.int32, [STAGES, 8 * FRAGS, 128], w_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, ROWS, 128], A_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    row0 = tb * BN
    nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    tile = s0 // NKB
    kb = s0 - tile * NKB
    t_in = tile
    kb_in = kb
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n)
        tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, FRAGS), 0], bars.index(i), w_box.index(i), pred=i < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)
    if PDL:
        _grid_dependency(_WAIT_ASM)
    t_x = tile
    kb_x = kb
    for i in gl.static_range(STAGES):
        tma_async_load(x_desc, [row0, kb_x * 128], bars.index(i), x_smem.index(i), pred=i < n)
        t_x, kb_x = _next_step(t_x, kb_x, NKB)

    acc = gl.zeros([ROWS, BN], dtype=gl.float32, layout=MMA)
    stage = 0
    phase = 0
    ab = 0
    i = 0
    # One inner loop a row tile: the accumulator is in flight over the inner loop's back edge only
    # (a tile's store inside the step loop made ptxas wait for every step's MMAs at its end).
    for tile in range(s0 // NKB, (s0 + n - 1) // NKB + 1):
        k0 = gl.maximum(s0 - tile * NKB, 0)
        for kb in range(k0, gl.minimum(s0 + n - tile * NKB, NKB)):
            mbarrier.wait(bars.index(stage), phase)
            w = w_box.index(stage).reshape([NW, R2, 8, 4, 2, 2]).permute([0, 1, 2, 4, 3, 5]).load(WL)
            a_smem.index(ab).store(_decoded_fp8(w, BITS, L8, ROWS))
            fence_async_shared()
            acc = warpgroup_mma(a_smem.index(ab), x_smem.index(stage).permute((1, 0)), acc, use_acc=kb != k0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # Every warpgroup has retired step i - 1's MMAs past this barrier: its activation stage
            # and its weight buffer (the one step i + 1 decodes into) are free.
            gl.thread_barrier()
            if i >= 1:  # refill the stage of step i - 1 with step i - 1 + STAGES
                rs = gl.where(stage == 0, STAGES - 1, stage - 1)
                j = i - 1 + STAGES
                mbarrier.expect(bars.index(rs), nbytes, pred=j < n)
                tma_async_load(w_desc, [_word_row(t_in, kb_in, NKB, FRAGS), 0], bars.index(rs), w_box.index(rs),
                               pred=j < n)
                tma_async_load(x_desc, [row0, kb_in * 128], bars.index(rs), x_smem.index(rs), pred=j < n)
                t_in, kb_in = _next_step(t_in, kb_in, NKB)
            i += 1
            ab ^= 1
            stage += 1
            phase ^= (stage == STAGES).to(gl.int32)
            stage = gl.where(stage == STAGES, 0, stage)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _store_rows(ws_ptr, acc, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN, ROWS, MMA)
    if PDL:
        _grid_dependency(_RELEASE_ASM)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _fragment_kernel(words_ptr, out_ptr, NKB, BITS: gl.constexpr):
    """Test kernel: writes the e4m3 A fragment the GEMM multiplies for (row block, k block) =
    program id at T[64 nb + row, 128 kb + fp8 MMA column]: e4m3(64 T) of the reference, bit for bit."""
    nb = gl.program_id(0)
    kb = gl.program_id(1)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 8, 32])
    A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=4)
    WL: gl.constexpr = WORDS_LAYOUT
    off = (((_iota(4, 0, 6, WL) * 2 + _iota(2, 1, 6, WL)) * 32 + _iota(8, 2, 6, WL) * 4 + _iota(4, 4, 6, WL)) * 4
           + _iota(2, 3, 6, WL) * 2 + _iota(2, 5, 6, WL))
    w = gl.load(words_ptr + (((nb // 2) * NKB + kb) * 2 + nb % 2).to(gl.int64) * 1024 + off)
    a = _decode_fp8_fragment(w, BITS, FP8_FRAGMENT_LAYOUT, A_LAYOUT)
    rows = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, A_LAYOUT))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, A_LAYOUT))
    gl.store(out_ptr + rows[:, None].to(gl.int64) * (NKB * 128) + cols[None, :], a)


def decoded_fragments(qw: QuantizedWeight) -> torch.Tensor:
    """e4m3 [Np, Kp]: e4m3(64 T) as the GEMM's A fragments hold it (fp8 MMA column order in each
    128-block). Equal bit for bit to ``mma_order(reference_core(qw))`` (tests)."""
    np_, kp = qw.padded_shape
    out = torch.empty((np_, kp), dtype=FP8_DTYPE, device=qw.device)
    _fragment_kernel[(np_ // FRAGMENT_ROWS, kp // BLOCK_K)](_packed(qw).words, out, kp // BLOCK_K, BITS=qw.bits,
                                                           num_warps=4)
    return out


def reference_core(qw: QuantizedWeight) -> torch.Tensor:
    """e4m3(64 T) [Np, Kp] from the reference codec (64 T is exact; e4m3 rounds to nearest even),
    in T's own column order: what ``decoded_fragments`` must equal in the fp8 MMA order."""
    return (decode_trellis(qw).float() * 64).to(FP8_DTYPE)


def mma_order(t: torch.Tensor) -> torch.Tensor:
    """t [..., Kp] with each 128-column block permuted into the fp8 MMA column order."""
    return permute_blocks(t, fp8_mma_column_order(t.device))


# -- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeFp8Config:
    """Launch parameters of the fp8 decode GEMM (see ``decode_fp8_config``)."""

    block_tokens: int  # wgmma N: tokens per program (power of two, 8..256)
    programs: int  # programs per token block, sharing its row tiles x k-blocks evenly
    stages: int  # activation and word buffers in the TMA ring
    dependent_launch: bool  # the three kernels as programmatic dependents, the GEMM starting early


#: Programs one SM holds, by token block: the registers and shared memory of the rule's sm_90a
#: builds under triton 3.6 (tests/test_decode_fp8.py checks the table against the compiler).
PROGRAMS_PER_SM = {64: 4, 128: 3, 256: 2}
MIN_STEPS = 2  # k-blocks a program takes at least


def rule_variant(m: int) -> tuple[int, int]:
    """(block_tokens, stages) for m tokens: one block of up to 256 tokens (every weight decoded
    once up to 256), a ring of 2 at 256 tokens (shared memory for two programs an SM) and 3 below."""
    block_tokens = min(MAX_TOKENS, max(64, triton.next_power_of_2(m)))
    return block_tokens, 2 if block_tokens == 256 else 3


def decode_fp8_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DecodeFp8Config:
    """The rule: ``rule_variant``'s block, one wave of programs (PROGRAMS_PER_SM a streaming
    multiprocessor) shared among the token blocks, each at least MIN_STEPS k-blocks."""
    return config_with_block(qw, m, None, device)


def config_with_block(qw: QuantizedWeight, m: int, block_tokens: int | None,
                      device: torch.device | None = None) -> DecodeFp8Config:
    """The rule's configuration with token blocks of ``block_tokens`` (64, 128 or 256; None: the
    rule's own), with that block's ring and wave: what the benchmark's other arms time."""
    if m < 1:
        raise ValueError(f"need at least one token, got {m}")
    if block_tokens is not None and block_tokens not in PROGRAMS_PER_SM:
        raise ValueError(f"block_tokens must be one of {sorted(PROGRAMS_PER_SM)}, got {block_tokens}")
    return _config(*qw.padded_shape, m, block_tokens, device)


@functools.lru_cache(maxsize=4096)
def _config(np_: int, kp: int, m: int, block_tokens: int | None, device: torch.device | None) -> DecodeFp8Config:
    block_tokens, stages = rule_variant(m if block_tokens is None else block_tokens)
    on_gpu = device is not None and device.type == "cuda" and torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else HOPPER_SMS
    steps = np_ // FRAGMENT_ROWS * (kp // BLOCK_K)
    slots = PROGRAMS_PER_SM.get(block_tokens, 1) * sms
    programs = max(1, min(steps // MIN_STEPS, triton.cdiv(slots, triton.cdiv(m, block_tokens))))
    return DecodeFp8Config(block_tokens=block_tokens, programs=programs, stages=stages,
                           dependent_launch=device is None or dependent_launch_supported(device))


def gemm_source(bits: int, block_tokens: int, stages: int, pdl: bool = True):
    """The GEMM kernel specialized as a launch specializes it, for ``triton.compile`` off the GPU
    (the tests' sm_90a builds)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"x_desc": f"tensordesc<fp8e4nv[{block_tokens}, {BLOCK_K}],{x_smem_layout(block_tokens)!r}>",
           "w_desc": f"tensordesc<i32[8, {BLOCK_K}],{WORDS_SMEM_LAYOUT!r}>", "ws_ptr": "*fp32",
           "M": "i32", "Np": "i32", "NKB": "i32", "STEPS": "i32", "PROGRAMS": "i32",
           "BITS": "constexpr", "BN": "constexpr", "STAGES": "constexpr", "PDL": "constexpr"}
    return GluonASTSource(_decode_fp8_kernel, sig,
                          constexprs={"BITS": bits, "BN": block_tokens, "STAGES": stages, "PDL": pdl},
                          attrs={(2,): [["tt.divisibility", 16]]})


@functools.cache
def a_smem_layout(rows: int) -> gl.NVMMASharedLayout:
    """Shared layout of a decoded weight tile [rows, 128] e4m3 (wgmma's A operand from shared memory)."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)


def staged_source(bits: int, block_tokens: int, stages: int, wm: int, wn: int, pdl: bool = True):
    """The staged GEMM specialized as a launch specializes it, for ``triton.compile`` off the GPU."""
    from triton.experimental.gluon._runtime import GluonASTSource
    frags = wm // 4
    sig = {"x_desc": f"tensordesc<fp8e4nv[{block_tokens}, {BLOCK_K}],{x_smem_layout(block_tokens)!r}>",
           "w_desc": f"tensordesc<i32[{8 * frags}, {BLOCK_K}],{WORDS_SMEM_LAYOUT!r}>", "ws_ptr": "*fp32",
           "M": "i32", "Np": "i32", "NKB": "i32", "STEPS": "i32", "PROGRAMS": "i32",
           "BITS": "constexpr", "BN": "constexpr", "STAGES": "constexpr", "WM": "constexpr",
           "WN": "constexpr", "A_SMEM": "constexpr", "PDL": "constexpr"}
    return GluonASTSource(_decode_fp8_staged_kernel, sig,
                          constexprs={"BITS": bits, "BN": block_tokens, "STAGES": stages, "WM": wm, "WN": wn,
                                      "A_SMEM": a_smem_layout(16 * wm), "PDL": pdl},
                          attrs={(2,): [["tt.divisibility", 16]]})


def decode_fp8(x: torch.Tensor, qw: QuantizedWeight, *, config: DecodeFp8Config | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T on a Hopper GPU on the fp8 tensor cores, in x's dtype.

    x may be fp16, bf16 or fp32, any strides; ``out``, if given, is a preallocated
    [M, out_features] tensor of x's dtype with unit column stride. The weight's words are repacked
    on the first call (``decode_wgmma.packed_words``).

    Three kernels, programmatic dependents where the device has them: ``transforms.prepare_input``
    with ``fp8`` (x' * 2**e in e4m3, fp8 MMA column order), the GEMM (fp32 partials), and
    ``transforms.hadamard_output`` (their sum, Hn, the row scales, 2**-e / 64). Accuracy is the
    fp8 paths' (e4m3 weights and activations).
    """
    check_operands(x, qw, "decode_fp8")
    check_codebook(qw, "decode_fp8")
    if not runs_on(x.device, qw.bits):
        raise ValueError(f"decode_fp8 runs on Hopper GPUs (sm_90) for K in {SUPPORTED_BITS}; "
                         f"got {x.device} and K={qw.bits} (escha.matmul picks another path there)")
    return _launch(x, qw, config, out)


def _launch(x: torch.Tensor, qw: QuantizedWeight, config: DecodeFp8Config | None,
            out: torch.Tensor | None) -> torch.Tensor:
    """Allocate and launch the three kernels (operands already checked; compile_check calls it
    off the GPU)."""
    x2d = x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or decode_fp8_config(qw, m, x.device)
    pdl = cfg.dependent_launch
    xq, inv, _ = prepare_input(x2d, qw, dependent_launch=pdl, release_early=pdl, keep=False, fp8=True)
    ws, counts = gemm_partials(xq, qw, cfg)
    y = output_tensor(x, m, qw.out_features, out)
    hadamard_output(ws, qw, inv, y, dependent_launch=pdl, segments=counts)
    return y.reshape(*x.shape[:-1], qw.out_features)


def gemm_partials(xq: torch.Tensor, qw: QuantizedWeight, cfg: DecodeFp8Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM alone: fp32 partials [segments, M, Np] of x'_q (e4m3 [M, Kp], fp8 MMA column
    order: ``prepare_input(..., fp8=True)``) against e4m3(64 T), and each 64-row group's count of them (``hadamard_output``'s
    ``segments``; the other partials are left unwritten)."""
    m = xq.shape[0]
    np_, kp = qw.padded_shape
    if xq.dtype != FP8_DTYPE or xq.shape[1] != kp:
        raise ValueError(f"x' must be {FP8_DTYPE} [M, {kp}], got {xq.dtype} {list(xq.shape)}")
    nkb = kp // BLOCK_K
    tiles = np_ // FRAGMENT_ROWS
    programs = min(cfg.programs, tiles * nkb)
    # Built once per grid (device ops inside a graph would be kernels of every replay).
    counts = device_constant(("segments", programs, tiles, nkb, 1), xq.device,
                             lambda: segment_counts(programs, tiles, nkb, 1, xq.device))
    ws = torch.empty((_most_segments(programs, tiles, nkb), m, np_), dtype=torch.float32, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_tokens, BLOCK_K], x_smem_layout(cfg.block_tokens))
    grid = (programs, triton.cdiv(m, cfg.block_tokens))
    prepare(_decode_fp8_kernel, grid, x_desc, _packed(qw).descs[1], ws, m, np_, nkb, tiles * nkb,
            programs, slots=None, BITS=qw.bits, BN=cfg.block_tokens, STAGES=cfg.stages,
            PDL=cfg.dependent_launch, num_warps=4, launch_pdl=cfg.dependent_launch)
    return ws, counts

@dataclass(frozen=True)
class StagedConfig:
    """Launch parameters of the staged fp8 GEMM (``_decode_fp8_staged_kernel``)."""

    block_tokens: int  # wgmma N (all warpgroups together)
    stages: int  # TMA ring, at least 2 (a stage is refilled one step after its use)
    wm: int  # warps along the rows: 4 or 8 (row tiles of 64 or 128 rows)
    wn: int  # warps along the tokens: 1 or 2
    per_sm: int  # programs an SM holds (the build's registers and shared memory)
    max_registers: int | None = None
    dependent_launch: bool = True


def staged_partials(xq: torch.Tensor, qw: QuantizedWeight, cfg: StagedConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemm_partials`` through the staged kernel: one wave of programs at ``cfg.per_sm``."""
    m = xq.shape[0]
    np_, kp = qw.padded_shape
    if xq.dtype != FP8_DTYPE or xq.shape[1] != kp:
        raise ValueError(f"x' must be {FP8_DTYPE} [M, {kp}], got {xq.dtype} {list(xq.shape)}")
    if cfg.wm not in (4, 8) or cfg.wn not in (1, 2) or cfg.stages < 2:
        raise ValueError(f"need wm 4 or 8, wn 1 or 2 and 2 stages or more, got {cfg}")
    frags = cfg.wm // 4
    nkb = kp // BLOCK_K
    tiles = np_ // (FRAGMENT_ROWS * frags)
    sms = torch.cuda.get_device_properties(xq.device).multi_processor_count if xq.is_cuda else HOPPER_SMS
    blocks = triton.cdiv(m, cfg.block_tokens)
    programs = max(1, min(tiles * nkb // MIN_STEPS, triton.cdiv(cfg.per_sm * sms, blocks)))
    counts = device_constant(("segments", programs, tiles, nkb, frags), xq.device,
                             lambda: segment_counts(programs, tiles, nkb, frags, xq.device))
    ws = torch.empty((_most_segments(programs, tiles, nkb), m, np_), dtype=torch.float32, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_tokens, BLOCK_K], x_smem_layout(cfg.block_tokens))
    prepare(_decode_fp8_staged_kernel, (programs, blocks), x_desc, _packed(qw).descs[frags], ws, m, np_, nkb,
            tiles * nkb, programs, slots=None, BITS=qw.bits, BN=cfg.block_tokens, STAGES=cfg.stages, WM=cfg.wm,
            WN=cfg.wn, A_SMEM=a_smem_layout(16 * cfg.wm), PDL=cfg.dependent_launch, num_warps=cfg.wm * cfg.wn,
            launch_pdl=cfg.dependent_launch, maxnreg=cfg.max_registers)
    return ws, counts


def staged_call(x: torch.Tensor, qw: QuantizedWeight, cfg: StagedConfig) -> torch.Tensor:
    """The whole product through the staged GEMM (input transform, GEMM, output transform)."""
    x2d = x.reshape(-1, x.shape[-1])
    pdl = cfg.dependent_launch
    xq, inv, _ = prepare_input(x2d, qw, dependent_launch=pdl, release_early=pdl, keep=False, fp8=True)
    ws, counts = staged_partials(xq, qw, cfg)
    y = output_tensor(x, x2d.shape[0], qw.out_features, None)
    hadamard_output(ws, qw, inv, y, dependent_launch=pdl, segments=counts)
    return y.reshape(*x.shape[:-1], qw.out_features)


# -- Why the configuration is what it is ---------------------------------------------------------
# Measured on one H200 (torch 2.11+cu130, triton 3.6.0), CUDA graphs, weights rotated past L2,
# median of 3, benchmarks/bench_decode_fp8.py at c0427fb (docs/KERNELS.md, "Register-operand decode
# on the fp8 tensor cores"). One fragment a program: two spill (232 bytes at 128 tokens). Token
# blocks of up to 256, each weight decoded once up to 256 tokens: at 256 tokens on gate_up the
# 256-token block took 110.5 us against 131.1 for two blocks of 128 (3 programs an SM), and at
# K=3 109.6 against 114.7; on the narrower down projection the blocks of 128 won (72.5 against
# 81.3 at K=2, 62.8 against 79.8 at K=3), not yet explained, so the block does not follow the
# shape. One wave of programs (PROGRAMS_PER_SM from the builds' registers and shared memory), the
# even split and the dependent launches are decode_wgmma's, measured there. The path is not in
# escha.matmul's rule (same section: where it wins, and at what accuracy).
