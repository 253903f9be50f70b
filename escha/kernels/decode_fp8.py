"""Decode GEMM on the fp8 tensor cores (Hopper), for 65 to a few hundred tokens.

    z^T [16 WM weight rows, tokens] += e4m3(16 T_blk) [16 WM, 128] @ x'_q^T [128, tokens]

The register-operand decode kernel's words (``decode_wgmma.pack_words``, here loaded straight into
registers two steps ahead), even split of (row tile, k-block) steps over one wave of programs, TMA
ring for the activations and split-K partials for ``transforms.hadamard_output`` (bf16 pairs, two
tokens a word, in the 64- and 128-token builds; fp32 in the 256-token one); but the decoded
weights are 16 T (``common.DECODE_FP8_SCALE_LOG2``: the codec forms them with no multiply,
|16 T| < 64, no saturation) rounded to e4m3, stored to shared memory (``stmatrix``), and each
step is ``wgmma ... .e4m3.e4m3`` with both operands from shared memory, issued asynchronously:
the next step's decode runs while this step's MMAs do. The activations are e4m3 (the input
transform's ``fp8`` form: x' times a power of two per token, |x' 2**e| <= 2**8).
Half the tensor-core time and half the activation bytes of the fp16 kernel, at the fp8 paths'
accuracy (docs/KERNELS.md, Prefill, "Accuracy"), and token blocks up to 256 (each weight decoded
once up to 256 tokens): ``escha.matmul``'s path from 65 to 256 tokens on Hopper
(``DispatchRule.decode_max_m``, ``fp8_decode_max_m``), where the fp16 kernel's MMAs, waited for
each step, cost as much as its decode.

Layout. The MMA's k order inside a 128-block is ours (``transforms.prepare_input(..., fp8=True, mma_order=True)``
stores x' the same way); it is the order the decode produces, in which a thread owns tiles 2t and
2t + 1 of the block (whose row windows are the fp16 kernel's words) and each 32-bit register
four of their columns:

    MMA column kk = 32 s + 16 h + 4 t + 2 u + e   holds   T column 16 (2t + u) + (2 s + h) + 8 e

so a register's four bytes are columns c and c + 8 (c = 2 s + h) of tiles 2t and 2t + 1: at K=2
each pair is one funnel shift (``decode_wgmma._pair_values_x16``: 16 T straight from the codec),
then one cvt.rn.satfinite.e4m3x2.f16x2, and four ``stmatrix`` a thread a step store the tile.
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
from ..norm import HeadNorm, RowNorm
from .common import (
    DECODE_FP8_SCALE_LOG2,
    FP8_DTYPE,
    Prepared,
    dependent_launch_supported,
    device_constant,
    output_tensor,
    prepare,
    weight_plans,
)
from .decode_wgmma import (
    _RELEASE_ASM,
    _WAIT_ASM,
    BLOCK_K,
    FRAGMENT_ROWS,
    HOPPER_SMS,
    _grid_dependency,
    _iota,
    _most_segments,
    _next_step,
    _packed,
    _pair_values_x16,
    _state_values_x16,
    _states,
    _word_row,
    check_call,
    permute_blocks,
    segment_counts,
    x_descriptor,
)
from .transforms import KeptPlan, plan_key, prepare_input, prepare_output, run_kept
from .triton_compat import cta_barrier, tma_async_load

MAX_TOKENS = 256  # wgmma N: tokens per program at most


@functools.cache
def x_smem_layout(block_tokens: int) -> gl.NVMMASharedLayout:
    """Shared layout of an activation tile [block_tokens, 128] e4m3 (wgmma's B operand, K-major)."""
    return gl.NVMMASharedLayout.get_default_for([block_tokens, BLOCK_K], gl.float8e4nv)


@functools.cache
def a_smem_layout(rows: int) -> gl.NVMMASharedLayout:
    """Shared layout of a decoded weight tile [rows, 128] e4m3 (wgmma's A operand)."""
    return gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)


def fp8_mma_column_order(device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [128]: the T column (within a 128-block) that MMA column kk multiplies."""
    kk = torch.arange(BLOCK_K, device=device)
    s, h, t, u, e = kk // 32, (kk // 16) % 2, (kk // 4) % 4, (kk // 2) % 2, kk % 2
    return 16 * (2 * t + u) + 2 * s + h + 8 * e


# -- device code ------------------------------------------------------------------------------

@gluon.jit
def _decoded_fp8(w, BITS: gl.constexpr, L8: gl.constexpr, ROWS: gl.constexpr):
    """e4m3(16 T) [ROWS, 128] (fp8 MMA column order) from the words ``w`` of a step (layout WL
    of the kernel: [warp, 8-row group, g, tile half, t, hi/lo]), in the registers the decode
    leaves it: L8 ([warp, 8-row group, g, s, h, u, t, e]) with t and u traded."""
    W7: gl.constexpr = gl.SliceLayout(7, L8)
    W5: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, W7))
    hi, lo = gl.split(w)  # [warp, row group, g, u, t]
    hi = gl.expand_dims(gl.expand_dims(gl.convert_layout(hi, W5), 3), 4).to(gl.uint32, bitcast=True)
    lo = gl.expand_dims(gl.expand_dims(gl.convert_layout(lo, W5), 3), 4).to(gl.uint32, bitcast=True)
    v = (hi.to(gl.uint64) << 32) | lo.to(gl.uint64)  # [warps, groups, 8, 1, 1, 2, 4] row windows
    c = (2 * _iota(4, 3, 7, W7) + _iota(2, 4, 7, W7)).to(gl.uint64)  # tile column c = 2 s + h
    if BITS == 2:
        va, vb = _pair_values_x16(((v << (2 * c)) >> 32).to(gl.uint32))
    else:
        va, vb = _state_values_x16(*_states(v, c, BITS))
    a = gl.join(va, vb).to(gl.float8e4nv)  # 16 T, exact in fp16; e4m3 rounds to nearest even
    return gl.reshape(gl.permute(a, [0, 1, 2, 3, 4, 6, 5, 7]), [ROWS, 128])


@gluon.jit
def _store_rows(ws_ptr, acc, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN: gl.constexpr, ROWS: gl.constexpr,
                MMA: gl.constexpr, PAIRS: gl.constexpr):
    """Program p's part of row tile ``tile`` (ROWS rows, accumulator [ROWS, BN] in layout MMA) as
    its segment of the partials (``decode_wgmma._store_partials``'s rule): fp32 [segments, M, Np],
    or with PAIRS int32 words [segments, (M + 1) // 2, Np] whose low and high bf16 halves are
    tokens 2i and 2i + 1 of a row. A thread holds those two tokens: one cvt packs them, one 32-bit
    store writes them, and eight lanes' rows fill a 32-byte sector, as fp32 partials do with twice
    the bytes."""
    seg = p - (((tile * NKB + 1).to(gl.int64) * PROGRAMS + STEPS - 1) // STEPS).to(gl.int32) + 1
    # Np and M through an opaque move: the offsets and the mask are computed here, not hoisted out
    # of the loop into registers held across it (one a stored element: 110 more registers at 128
    # tokens, offline).
    Np, M = gl.inline_asm_elementwise("mov.b32 $0, $2; mov.b32 $1, $3;", "=r,=r,r,r", [Np, M],
                                      dtype=(gl.int32, gl.int32), is_pure=False, pack=1)
    if PAIRS:
        v = acc.to(gl.bfloat16).reshape([ROWS, BN // 2, 2])  # a thread's two adjacent tokens (registers only)
        VL: gl.constexpr = v.type.layout
        pair = gl.arange(0, BN // 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, VL)))
        rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, VL)))
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, VL)))
        base = ws_ptr + (seg * ((M + 1) // 2) + row0 // 2).to(gl.int64) * (2 * Np)
        offs = (pair[None, :] * Np + rows[:, None]) * 2
        gl.store(base + offs[:, :, None] + half[None, None, :], v,
                 mask=(2 * pair[None, :] < M - row0)[:, :, None])
    else:
        tok = gl.arange(0, BN, layout=gl.SliceLayout(0, MMA))
        rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, MMA))
        base = ws_ptr + (seg * M + row0).to(gl.int64) * Np
        gl.store(base + tok[None, :] * Np + rows[:, None], acc, mask=tok[None, :] < M - row0)


@gluon.jit
def _step_words(words_ptr, tile, kb, NKB, ok, NW: gl.constexpr, R2: gl.constexpr, WL: gl.constexpr):
    """The words of step (tile, kb) in the decode's layout WL, straight from global memory (the
    rows of ``_word_row``: each thread's four words of a row group are one 16-byte run, each warp's
    load 512 contiguous bytes); zeros where not ``ok``."""
    FRAGS: gl.constexpr = NW * R2 // 8
    L3: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 4], threads_per_warp=[1, 1, 32],
                                        warps_per_cta=[NW, 1, 1], order=[2, 1, 0])
    offs = (_iota(NW, 0, 3, L3) * (R2 * 128) + _iota(R2, 1, 3, L3) * 128 + _iota(128, 2, 3, L3))
    base = words_ptr + _word_row(tile, kb, NKB, FRAGS).to(gl.int64) * 128
    w = gl.load(base + offs, mask=(offs >= 0) & ok, other=0)
    return gl.convert_layout(w.reshape([NW, R2, 8, 4, 2, 2]).permute([0, 1, 2, 4, 3, 5]), WL, assert_trivial=True)


@gluon.jit
def _decode_fp8_kernel(x_desc, words_ptr, ws_ptr, M, Np, NKB, STEPS, PROGRAMS,
                       BITS: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, WM: gl.constexpr,
                       WN: gl.constexpr, A_SMEM: gl.constexpr, PDL: gl.constexpr, PAIRS: gl.constexpr):
    """Program (p, token block): steps [p STEPS / PROGRAMS, (p + 1) STEPS / PROGRAMS) of the token
    block's row tiles (16 WM rows) x NKB k-blocks, each z^T[16 WM rows, BN tokens] += e4m3(16 T_blk)
    x'_q^T, written as partials (``decode_wgmma``'s even split; fp32 [segments, M, Np], or with
    PAIRS bf16 pairs, ``_store_rows``). Each step's words come from global memory into registers two
    steps ahead, its activation tile by TMA into a ring of STAGES; the warps decode the tile's e4m3
    weights into one of two shared buffers, and the wgmma reads both operands from shared memory,
    asynchronously: step i's decode runs while step i - 1's MMAs do. Three CTA barriers a step:
    before the activations' wait (which also orders the decoded tile before the MMAs), after the MMA
    wait, and the one Triton puts between the refill's expect and its copy. WM warps split the
    tile's rows, WN its tokens (each warpgroup's MMA takes BN / WN of them); every warp decodes 16 /
    WN rows. With PDL it fetches its first words while the input transform runs, then waits for x',
    and releases the output transform after its loop."""
    p = gl.program_id(0)
    tb = gl.program_id(1)
    s0 = ((p.to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32)
    n = (((p + 1).to(gl.int64) * STEPS) // PROGRAMS).to(gl.int32) - s0
    NW: gl.constexpr = WM * WN
    ROWS: gl.constexpr = 16 * WM
    R2: gl.constexpr = 2 // WN  # 8-row groups a warp decodes

    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WM, WN],
                                                  instr_shape=[16, BN // WN, 32])
    L8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 4, 2, 2, 1, 2],
                                        threads_per_warp=[1, 1, 8, 1, 1, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1, 1, 1], order=[7, 5, 1, 4, 3, 6, 2, 0])
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])

    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BN, 128], x_desc.layout)
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, ROWS, 128], A_SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()

    row0 = tb * BN
    nbytes: gl.constexpr = x_desc.block_type.nbytes
    tile = s0 // NKB
    kb = s0 - tile * NKB
    w_now = _step_words(words_ptr, tile, kb, NKB, n > 0, NW, R2, WL)
    t_w, kb_w = _next_step(tile, kb, NKB)
    w_next = _step_words(words_ptr, t_w, kb_w, NKB, n > 1, NW, R2, WL)
    t_w, kb_w = _next_step(t_w, kb_w, NKB)  # the next words to fetch: step 2
    if PDL:
        _grid_dependency(_WAIT_ASM)
    t_in = tile
    kb_in = kb
    for i in gl.static_range(STAGES):
        mbarrier.expect(bars.index(i), nbytes, pred=i < n)
        tma_async_load(x_desc, [row0, kb_in * 128], bars.index(i), x_smem.index(i), pred=i < n)
        t_in, kb_in = _next_step(t_in, kb_in, NKB)

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
            w = w_now
            w_now = w_next
            w_next = _step_words(words_ptr, t_w, kb_w, NKB, i + 2 < n, NW, R2, WL)
            t_w, kb_w = _next_step(t_w, kb_w, NKB)
            a_smem.index(ab).store(_decoded_fp8(w, BITS, L8, ROWS))
            fence_async_shared()
            mbarrier.wait(bars.index(stage), phase)
            acc = warpgroup_mma(a_smem.index(ab), x_smem.index(stage).permute((1, 0)), acc, use_acc=kb != k0,
                                is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # Every warpgroup has retired step i - 1's MMAs past this barrier: its activation stage
            # and its weight buffer (the one step i + 1 decodes into) are free.
            cta_barrier()
            if i >= 1:  # refill the stage of step i - 1 with step i - 1 + STAGES
                rs = gl.where(stage == 0, STAGES - 1, stage - 1)
                j = i - 1 + STAGES
                mbarrier.expect(bars.index(rs), nbytes, pred=j < n)
                tma_async_load(x_desc, [row0, kb_in * 128], bars.index(rs), x_smem.index(rs), pred=j < n)
                t_in, kb_in = _next_step(t_in, kb_in, NKB)
            i += 1
            ab ^= 1
            stage += 1
            phase ^= (stage == STAGES).to(gl.int32)
            stage = gl.where(stage == STAGES, 0, stage)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _store_rows(ws_ptr, acc, p, tile, M, Np, NKB, STEPS, PROGRAMS, row0, BN, ROWS, MMA, PAIRS)
    if PDL:
        _grid_dependency(_RELEASE_ASM)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _fragment_kernel(words_ptr, out_ptr, NKB, BITS: gl.constexpr, WN: gl.constexpr):
    """Test kernel: writes the e4m3 tile the GEMM stores for (64-row block, k block) = program id
    at T[64 nb + row, 128 kb + fp8 MMA column], decoded by 4 WN warps as the GEMM's builds with
    WN warpgroups along the tokens decode it: e4m3(16 T) of the reference, bit for bit."""
    nb = gl.program_id(0)
    kb = gl.program_id(1)
    NW: gl.constexpr = 4 * WN
    R2: gl.constexpr = 2 // WN
    WL: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 2, 1, 2], threads_per_warp=[1, 1, 8, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1], order=[5, 3, 1, 4, 2, 0])
    L8: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, R2, 1, 4, 2, 2, 1, 2],
                                        threads_per_warp=[1, 1, 8, 1, 1, 1, 4, 1],
                                        warps_per_cta=[NW, 1, 1, 1, 1, 1, 1, 1], order=[7, 5, 1, 4, 3, 6, 2, 0])
    OUT: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[8, 4], warps_per_cta=[NW, 1],
                                         order=[1, 0])
    w = _step_words(words_ptr, nb, kb, NKB, True, NW, R2, WL)  # the GEMM's own load of a 64-row tile's words
    a = gl.convert_layout(_decoded_fp8(w, BITS, L8, 64), OUT)
    rows = nb * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, OUT))
    cols = kb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, OUT))
    gl.store(out_ptr + rows[:, None].to(gl.int64) * (NKB * 128) + cols[None, :], a)


def decoded_fragments(qw: QuantizedWeight, warps_n: int = 1) -> torch.Tensor:
    """e4m3 [Np, Kp]: e4m3(16 T) as the GEMM stores it for its MMAs (fp8 MMA column order in each
    128-block), decoded as its builds with ``warps_n`` warpgroups along the tokens decode it (1:
    16 rows a warp; 2: 8). Equal bit for bit to ``mma_order(reference_core(qw))`` (tests)."""
    if warps_n not in (1, 2):
        raise ValueError(f"warps_n must be 1 or 2, got {warps_n}")
    np_, kp = qw.padded_shape
    out = torch.empty((np_, kp), dtype=FP8_DTYPE, device=qw.device)
    _fragment_kernel[(np_ // FRAGMENT_ROWS, kp // BLOCK_K)](_packed(qw).words, out, kp // BLOCK_K, BITS=qw.bits,
                                                           WN=warps_n, num_warps=4 * warps_n)
    return out


def reference_core(qw: QuantizedWeight) -> torch.Tensor:
    """e4m3(16 T) [Np, Kp] from the reference codec (16 T is exact; e4m3 rounds to nearest even),
    in T's own column order: what ``decoded_fragments`` must equal in the fp8 MMA order."""
    return (decode_trellis(qw).float() * 2**DECODE_FP8_SCALE_LOG2.value).to(FP8_DTYPE)


def mma_order(t: torch.Tensor) -> torch.Tensor:
    """t [..., Kp] with each 128-column block permuted into the fp8 MMA column order."""
    return permute_blocks(t, fp8_mma_column_order(t.device))


# -- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DecodeFp8Config:
    """Launch parameters of the fp8 decode GEMM (see ``decode_fp8_config``)."""

    block_tokens: int  # wgmma N of the program (all its warpgroups): tokens per program, 64, 128 or 256
    stages: int  # activation and word buffers in the TMA ring (at least 2: a stage is refilled a step after its use)
    warps_m: int  # warps along the row tile: 4 or 8 (tiles of 64 or 128 weight rows)
    warps_n: int  # warpgroups along the tokens: 1 or 2
    programs: int  # programs per token block, sharing its row tiles x k-blocks evenly
    dependent_launch: bool  # the three kernels as programmatic dependents, the GEMM starting early
    max_registers: int | None = None  # ptxas register cap a thread (None: the compiler's choice)
    bf16_pairs: bool = False  # partials as bf16, two tokens a 32-bit word (PAIRED_BLOCKS); else fp32


#: The build of each token block: (stages, warps_m, warps_n, register cap), and the programs one SM
#: holds of it (registers and shared memory of the sm_90a build under triton 3.6, K = 2 and 3;
#: tests/test_decode_fp8.py checks the table against the compiler). Measured: note at the end. The
#: 64-token build's cap keeps 4 an SM with the add.f16 sum (163 registers uncapped, 3 an SM).
BUILDS = {64: (3, 4, 1, 128), 128: (2, 4, 1, 168), 256: (3, 8, 2, None)}
PROGRAMS_PER_SM = {64: 4, 128: 3, 256: 1}
#: The token blocks whose builds store their partials as bf16 pairs (the 256-token build's epilogue
#: spills with them under its 128-register bound: note at the end).
PAIRED_BLOCKS = frozenset({64, 128})
MIN_STEPS = 2  # k-blocks a program takes at least


def rule_block(m: int) -> int:
    """The token block for m tokens: a power of two from 64 to 256 (every weight decoded once up
    to 256 tokens, once per block of 256 above)."""
    return min(MAX_TOKENS, max(64, triton.next_power_of_2(m)))


def decode_fp8_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DecodeFp8Config:
    """The rule: ``rule_block``'s block in its build (BUILDS), one wave of programs
    (PROGRAMS_PER_SM a streaming multiprocessor) shared among the token blocks, each at least
    MIN_STEPS k-blocks; dependent launches wherever the device has them."""
    return config_with_block(qw, m, None, device)


def config_with_block(qw: QuantizedWeight, m: int, block_tokens: int | None,
                      device: torch.device | None = None) -> DecodeFp8Config:
    """The rule's configuration with token blocks of ``block_tokens`` (64, 128 or 256; None: the
    rule's own), in that block's build and wave: what the benchmark's other arms time."""
    if m < 1:
        raise ValueError(f"need at least one token, got {m}")
    if block_tokens is not None and block_tokens not in BUILDS:
        raise ValueError(f"block_tokens must be one of {sorted(BUILDS)}, got {block_tokens}")
    return _config(*qw.padded_shape, m, block_tokens, device)


def wave_programs(padded_shape: tuple[int, int], m: int, block_tokens: int, warps_m: int, per_sm: int,
                  sms: int) -> int:
    """Programs a token block takes: one wave of ``per_sm`` programs on each of ``sms`` SMs, shared
    among m's blocks of ``block_tokens``, each program at least MIN_STEPS of the weight's (row
    tile of 16 ``warps_m`` rows, k-block) steps (the rule's grid, for any build's occupancy)."""
    np_, kp = padded_shape
    steps = np_ // (16 * warps_m) * (kp // BLOCK_K)
    return max(1, min(steps // MIN_STEPS, triton.cdiv(per_sm * sms, triton.cdiv(m, block_tokens))))


@functools.lru_cache(maxsize=4096)
def _config(np_: int, kp: int, m: int, block_tokens: int | None, device: torch.device | None) -> DecodeFp8Config:
    block_tokens = rule_block(m) if block_tokens is None else block_tokens
    stages, warps_m, warps_n, cap = BUILDS[block_tokens]
    on_gpu = device is not None and device.type == "cuda" and torch.cuda.is_available()
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else HOPPER_SMS
    programs = wave_programs((np_, kp), m, block_tokens, warps_m, PROGRAMS_PER_SM[block_tokens], sms)
    return DecodeFp8Config(block_tokens=block_tokens, stages=stages, warps_m=warps_m, warps_n=warps_n,
                           programs=programs, dependent_launch=device is None or dependent_launch_supported(device),
                           max_registers=cap, bf16_pairs=block_tokens in PAIRED_BLOCKS)


def gemm_source(bits: int, block_tokens: int, pdl: bool = True, build: tuple[int, int, int] | None = None,
                pairs: bool | None = None):
    """The GEMM kernel in the rule's build of ``block_tokens`` (BUILDS), or in ``build`` (stages,
    warps_m, warps_n), with bf16-pair partials where ``pairs`` (None: the rule's, PAIRED_BLOCKS),
    specialized as a launch specializes it, for ``triton.compile`` off the GPU (the tests' and the
    census's sm_90a builds)."""
    from triton.experimental.gluon._runtime import GluonASTSource
    stages, wm, wn = build or BUILDS[block_tokens][:3]
    pairs = block_tokens in PAIRED_BLOCKS if pairs is None else pairs
    sig = {"x_desc": f"tensordesc<fp8e4nv[{block_tokens}, {BLOCK_K}],{x_smem_layout(block_tokens)!r}>",
           "words_ptr": "*i32", "ws_ptr": "*bf16" if pairs else "*fp32",
           "M": "i32", "Np": "i32", "NKB": "i32", "STEPS": "i32", "PROGRAMS": "i32",
           "BITS": "constexpr", "BN": "constexpr", "STAGES": "constexpr", "WM": "constexpr",
           "WN": "constexpr", "A_SMEM": "constexpr", "PDL": "constexpr", "PAIRS": "constexpr"}
    return GluonASTSource(_decode_fp8_kernel, sig,
                          constexprs={"BITS": bits, "BN": block_tokens, "STAGES": stages, "WM": wm, "WN": wn,
                                      "A_SMEM": a_smem_layout(16 * wm), "PDL": pdl, "PAIRS": pairs},
                          attrs={(1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})


def compile_options(block_tokens: int, pdl: bool = True) -> dict:
    """``triton.compile`` options of ``gemm_source(bits, block_tokens, pdl)`` as a launch sets them."""
    _, wm, wn, cap = BUILDS[block_tokens]
    return {"num_warps": wm * wn, "launch_pdl": pdl, **({"maxnreg": cap} if cap else {})}


def decode_fp8(x: torch.Tensor, qw: QuantizedWeight, *, config: DecodeFp8Config | None = None,
               out: torch.Tensor | None = None, norm: RowNorm | None = None,
               head_norm: HeadNorm | None = None) -> torch.Tensor:
    """y[..., out] = x[..., in] @ W_hat^T on a Hopper GPU on the fp8 tensor cores, in x's dtype.

    x may be fp16, bf16 or fp32, any strides; ``out``, if given, is a preallocated
    [M, out_features] tensor of x's dtype with unit column stride. The weight's words are repacked
    on the first call (``decode_wgmma.packed_words``). ``norm`` (weight of x's dtype) is applied
    to x first, in the input transform: norm(x) @ W_hat^T; ``head_norm`` to the output's heads, in
    the output transform (as ``decode_wgmma``).

    Three kernels, programmatic dependents where the device has them: ``transforms.prepare_input``
    with ``fp8`` (x' * 2**e in e4m3, fp8 MMA column order), the GEMM (split-K partials), and
    ``transforms.hadamard_output`` (their sum, Hn, the row scales, 2**-e / 16). Accuracy is the
    fp8 paths' (e4m3 weights and activations).
    """
    check_call(x, qw, "decode_fp8", norm, head_norm)
    return launch_checked(x, qw, config, out, norm, head_norm)


_GRAPHS = ("decode_fp8", "graphs")  # the key of this op's graphs in a weight's plans


def launch_checked(x: torch.Tensor, qw: QuantizedWeight, config: DecodeFp8Config | None = None,
                   out: torch.Tensor | None = None, norm: RowNorm | None = None,
                   head_norm: HeadNorm | None = None) -> torch.Tensor:
    """``decode_fp8`` on operands the caller has checked (it does; so does escha.matmul's dispatch
    table, for the path its rule chose; compile_check calls it off the GPU): allocate and launch
    the three kernels.

    As ``decode_wgmma``'s: the first call of a weight, a layout of x and a set of settings
    launches through Triton and keeps the three launches prepared (a ``transforms.KeptPlan`` in
    ``common.weight_plans``); later calls with the same key run them again
    (``transforms.run_kept``: eager ones as one CUDA graph).
    """
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    m = x2d.shape[0]
    cfg = config or decode_fp8_config(qw, m, x.device)
    rows = triton.cdiv(m, cfg.block_tokens) * cfg.block_tokens  # x' in whole token blocks: no TMA box reaches past it
    plans = weight_plans(qw)
    key = plan_key("decode_fp8", qw, x2d, cfg, norm, head_norm, out)
    plan = plans.get(key)
    if plan is not None:
        layout = x_smem_layout(cfg.block_tokens)
        y = run_kept(plan, key, plans.setdefault(_GRAPHS, {}), x2d, out, norm, head_norm,
                     lambda: _parts(x2d, qw, plan.segments, rows, cfg),
                     lambda xq: x_descriptor(xq, cfg.block_tokens, layout))
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], qw.out_features)
    pdl = cfg.dependent_launch
    xq, inv, pin = prepare_input(x2d, qw, dependent_launch=pdl, release_early=pdl, norm=norm, fp8=True,
                                 mma_order=True, rows=rows)
    ws, counts, pgemm = _gemm(xq, qw, cfg, m, keep=True)
    y = output_tensor(x, m, qw.out_features, out)
    pout = prepare_output(ws, qw, inv, y, dependent_launch=pdl, head_norm=head_norm, segments=counts)
    if pin is not None and pgemm is not None and pout is not None:
        plans[key] = KeptPlan(ws.shape[0], pin, pgemm, pout)
    return y.reshape(*x.shape[:-1], qw.out_features)


def _parts(x2d: torch.Tensor, qw: QuantizedWeight, segs: int, rows: int, cfg: DecodeFp8Config) -> list:
    """The (shape, dtype) of a call's x, x', 2**-e, partials and y (``transforms.run_kept``)."""
    m, k = x2d.shape
    np_, kp = qw.padded_shape
    return [((m, k), x2d.dtype), ((rows, kp), FP8_DTYPE), ((m,), torch.float32), _partials_shape(m, np_, segs, cfg),
            ((m, qw.out_features), x2d.dtype)]


def _partials_shape(m: int, np_: int, segs: int, cfg: DecodeFp8Config) -> tuple[tuple[int, ...], torch.dtype]:
    """The GEMM's partials: int32 words [segs, (m + 1) // 2, Np] of bf16 pairs, or fp32 [segs, m, Np]."""
    if cfg.bf16_pairs:
        return (segs, (m + 1) // 2, np_), torch.int32
    return (segs, m, np_), torch.float32


def gemm_partials(xq: torch.Tensor, qw: QuantizedWeight, cfg: DecodeFp8Config,
                  tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM alone: the partials of x'_q (e4m3 [rows, Kp], fp8 MMA column order:
    ``prepare_input(..., fp8=True, mma_order=True)``) against e4m3(16 T), as fp32 [segments, M, Np]
    or, with ``cfg.bf16_pairs``, int32 words [segments, (M + 1) // 2, Np] that hold two tokens'
    bf16 partials each (``partial_values`` reads both), and each 64-row group's count of them
    (``hadamard_output``'s ``segments``; the other partials are left unwritten). M is ``tokens``
    (default: x''s rows); x' may have more rows, which are read and not stored."""
    return _gemm(xq, qw, cfg, tokens, keep=False)[:2]


def partial_values(words: torch.Tensor, tokens: int) -> torch.Tensor:
    """The partials [segments, tokens, Np] that ``gemm_partials`` returned: fp32 ones as they are,
    int32 words as the bf16 values they hold (token 2i in the low half of word row i, 2i + 1 in
    the high half; tests, benchmarks)."""
    s, half, np_ = words.shape
    if words.dtype == torch.float32 and 0 < tokens <= half:
        return words[:, :tokens]
    if words.dtype != torch.int32 or not 0 < tokens <= 2 * half:
        raise ValueError(f"need int32 words or fp32 partials of at least {tokens} tokens, "
                         f"got {words.dtype} {list(words.shape)}")
    lo = (words << 16).view(torch.float32)
    hi = (words & -65536).view(torch.float32)
    return torch.stack((lo, hi), 2).reshape(s, 2 * half, np_)[:, :tokens].to(torch.bfloat16)


def _gemm(xq: torch.Tensor, qw: QuantizedWeight, cfg: DecodeFp8Config, tokens: int | None,
          keep: bool) -> tuple[torch.Tensor, torch.Tensor, Prepared | None]:
    """Launch the GEMM through Triton: (partials, each 64-row group's count of them, the launch
    prepared when ``keep``)."""
    m = xq.shape[0] if tokens is None else tokens
    if not 1 <= m <= xq.shape[0]:
        raise ValueError(f"tokens must be 1..{xq.shape[0]} (x''s rows), got {m}")
    np_, kp = qw.padded_shape
    if xq.dtype != FP8_DTYPE or xq.shape[1] != kp:
        raise ValueError(f"x' must be {FP8_DTYPE} [M, {kp}], got {xq.dtype} {list(xq.shape)}")
    if cfg.warps_m not in (4, 8) or cfg.warps_n not in (1, 2) or cfg.stages < 2:
        raise ValueError(f"need warps_m 4 or 8, warps_n 1 or 2 and at least 2 stages, got {cfg}")
    frags = cfg.warps_m // 4
    nkb = kp // BLOCK_K
    tiles = np_ // (FRAGMENT_ROWS * frags)
    programs = min(cfg.programs, tiles * nkb)
    # Built once per grid (device ops inside a graph would be kernels of every replay).
    counts = device_constant(("segments", programs, tiles, nkb, frags), xq.device,
                             lambda: segment_counts(programs, tiles, nkb, frags, xq.device))
    shape, dtype = _partials_shape(m, np_, _most_segments(programs, tiles, nkb), cfg)
    ws = torch.empty(shape, dtype=dtype, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [cfg.block_tokens, BLOCK_K], x_smem_layout(cfg.block_tokens))
    grid = (programs, triton.cdiv(m, cfg.block_tokens))
    prepared = prepare(_decode_fp8_kernel, grid, x_desc, _packed(qw).words,
                       ws.view(torch.bfloat16) if cfg.bf16_pairs else ws, m, np_, nkb, tiles * nkb, programs,
                       slots=("x_desc", "ws_ptr") if keep else None, BITS=qw.bits, BN=cfg.block_tokens,
                       STAGES=cfg.stages, WM=cfg.warps_m, WN=cfg.warps_n, A_SMEM=a_smem_layout(16 * cfg.warps_m),
                       PDL=cfg.dependent_launch, PAIRS=cfg.bf16_pairs, num_warps=cfg.warps_m * cfg.warps_n,
                       launch_pdl=cfg.dependent_launch, maxnreg=cfg.max_registers)
    return ws, counts, prepared

# -- Why the configuration is what it is ---------------------------------------------------------
# Measured on one H200 (torch 2.11+cu130, triton 3.6.0), CUDA graphs, weights rotated past L2,
# median of 3, benchmarks/bench_decode_fp8.py (docs/KERNELS.md, "Decode on the fp8 tensor cores",
# where the numbers below are tabled).
# Shared memory, not registers: the first form of this kernel decoded into wgmma's register A
# operand (1379f2b-54c692a); triton 3.6 cannot keep an 8-bit register operand alive over an
# asynchronous wgmma, so each step waited for its MMAs before the next decode, and its 64-row
# tiles read each 32 KB activation tile of a 256-token block once per 64 rows. Staged through
# shared memory, the MMAs run under the next decode: the whole call at 256 tokens on gate_up /
# down / 8B down 79.6 / 48.1 / 58.0 us against 109.9 / 78.8 / 90.6 in the register form
# (results/decode_fp8/staged_h200_79f741a). At 64 tokens the register form was 6% faster (44.5
# against 47.4 on gate_up); the rule runs the fp16 kernel there.
# Builds (BUILDS), same run: blocks of 256 as 8 warps over 128 rows x 2 warpgroups along the
# tokens with a ring of 3 (one program an SM, 16 warps): 79.6 us against 88.7 for 4 warps over
# 64 rows (two an SM; ncu: 2.2 issue stalls an instruction waiting on the TMA ring, each
# activation tile read once per 64 rows) and 87.6 with two warpgroups along the tokens capped at
# 128 registers (two an SM); blocks of 128 as 4 warps over 64 rows with a ring of 2 (three an
# SM): 61.9 us against 63.9 with two warpgroups capped at 80 registers (three an SM) and 63.2
# with 8 x 2 warps capped at 64 (two); 64 tokens: 4 warps, ring of 3 (four an SM), 47.4 against
# 54.9 with two warpgroups along the tokens. More warps did not help: the loop is bound by its
# CTA barriers and TMA waits, not by the decode's issue (ncu, same folder).
# A tile's store sits after an inner loop over the tile's steps: inside the step loop it made
# ptxas wait for every step's MMAs at the loop's end (ncu: 7% of samples on that wait; the SASS
# test checks that the build has one wait for all MMAs).
# The words straight into registers (two steps ahead, 16-byte loads), not by TMA through shared
# memory (results/decode_fp8/h200_e1f0c99, one process beside the earlier file): 5 -> 3 CTA
# barriers a step; blocks of 128 (4 warps) 8-9% faster (gate_up / down / 8B down at 128 tokens
# 56.3 / 34.0 / 41.1 us against 61.6 / 36.5 / 44.6), blocks of 256 level (within 2%). The
# activations by cp.async as well (no mbarrier, 2 barriers a step; 86080f2) were 1-9% slower than
# either: the barriers are not what bounds the 256-token build. The 128-token build needs the cap
# of 168 registers to keep three programs an SM (171-183 without, by release and K).
# With it the fp8 GEMM beats the fp16 kernel from 96 tokens (13-22% at 96 and 128 on three
# shapes, K = 2 and 3) and loses at 32-64 (3-14%): DispatchRule.decode_max_m = 64
# (results/decode_fp8/h200_fdcb84e).
# The weights as 16 T from the codec (its xor constant's exponent bits; no mul.f16x2, halves summed
# by add.f16), the 64-token build then capped at 128 registers to keep four an SM
# (results/x16_xpad_h200, one process against c25f908's kernels): at K=2 gate_up / down / 8B down
# 48.2 / 30.0 / 35.6 us at 96 tokens against 49.8 / 30.2 / 36.6, 50.3 / 30.9 / 37.3 at 128 against
# 51.9 / 31.8 / 38.5; 0.4-1.2% slower at 192-256 (one program an SM: not issue-bound); K=3 3-4%
# faster at 128 tokens.
# x' with whole token blocks of rows (results/fp8_rows_h200, one process against 85f6207's
# kernels): a TMA box that runs far past x' costs the loop; at 72 tokens (56 rows past a 128-row
# box) gate_up / down / 8B down 46.4 / 27.5 / 33.9 us against 61.1 / 34.6 / 35.9 (x' rounded to 16
# rows only: 55.0 / 32.8 / 34.7), at 136 gate_up 66.3 against 68.9; 96 and 200 within 1%.
# Partials as bf16 pairs (PAIRED_BLOCKS), two tokens a 32-bit word: half the GEMM's stores and the
# output transform's reads, with no layout conversion in either kernel. On an H100, whole call in
# one process against fp32 partials (results/fp8_bf16_pairs/h100_0193475): 2-9% less at 72-128
# tokens on gate_up, down and 8B down (gate_up 128 48.3 against 52.3 us, down 128 29.2 against
# 32.0). Not in the 256-token build: under its 128-register bound the pair stores spill 128 bytes
# in the epilogue (every 32-bit form tried offline spilled), and the call was 1-7% slower at
# 136-256 on down and 8B down (down 256: the GEMM alone 34.9 -> 38.2 us) though its output
# transform halved (gate_up 256 15.2 -> 7.0 us). The builds here are those measured, SASS for SASS
# (results/fp8_pairs_blocks/offline.txt). On the H200 (results/fp8_pairs_blocks/h200_724c317): 2-8%
# less at 72-128 tokens on the same three shapes, the 256-token build level at 136-256.
