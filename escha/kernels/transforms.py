"""Incoherence transforms as Triton kernels: the activation side and the output side of a GEMM.

The GEMM runs in the transform domain:  y = crop( (Hn z) * g*c*su ),  z = x' T^T,
x' = Hk (sv * pad(x))  (escha.format.codec). Both Hadamards are block-diagonal with 128-blocks and
entries +-1/sqrt(128); the kernels multiply by the exact +-1 matrix and apply 1/sqrt(128) once in
fp32. The decode transforms (a few tokens) do it in registers, seven fp32 butterfly stages
(``common.hadamard128``); the output pass of a 16-bit library product (many tokens) on the
tensor cores.

Activation scaling. The GEMM's operands are fp16 (T is exactly fp16, so the weight side costs no
rounding at all). To keep x' inside fp16's range for any bf16/fp32 input, each token row is
multiplied by a power of two 2**e chosen from the row's max |x| so that |x' * 2**e| <= 2**15
(|x'| <= sqrt(128) * max|x|), and the output kernel multiplies by 2**-e. Powers of two are exact,
so the only cost is fp16's own rounding of x' (unit roundoff 2**-11).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK
from ..norm import HeadNorm, RowNorm
from .common import (DECODE_FP8_SCALE_LOG2, FP8_DTYPE, INV_SQRT_HAD, SQRT_HAD, TL_DTYPES, Parts, Prepared,
                     constant_vector, dot_dtype, hadamard128, hadamard_operand, interpreted, load_hadamard, output_tensor,
                     prepare, release_dependents, replayable, replayed, round_to, row_scale_block, row_sum128,
                     wait_for_producer)

#: The per-call tensors of the prepared transform launches (prepare_input, prepare_output).
INPUT_SLOTS = ("x_ptr", "xq_ptr", "inv_ptr", "nw_ptr")
OUTPUT_SLOTS = ("z_ptr", "y_ptr", "inv_ptr", "hw_ptr", "hb_ptr")


@triton.jit
def _normed(x, nw_ptr, k, mask, rstd, NORM: tl.constexpr, X_DTYPE: tl.constexpr):
    """x (fp32 values of x's dtype) as the model's RMSNorm returns it: weight * dtype(x * rstd),
    rounded to x's dtype (the norm's weight has x's dtype); x itself without NORM."""
    if NORM:
        w = tl.load(nw_ptr + k, mask=mask, other=0.0).to(tl.float32)
        return round_to(w * round_to(x * rstd, X_DTYPE).to(tl.float32), X_DTYPE).to(tl.float32)
    return x


@triton.jit
def _input_transform_kernel(x_ptr, sv_ptr, xq_ptr, inv_ptr, nw_ptr, eps, K_in, Kp, stride_xm, stride_xk,
                            CH: tl.constexpr, AMAX_BLOCK: tl.constexpr, AMAX_STEPS: tl.constexpr,
                            MMA_ORDER: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr,
                            RELEASE_EARLY: tl.constexpr, NORM: tl.constexpr, X_DTYPE: tl.constexpr,
                            FP8: tl.constexpr = False, BF16: tl.constexpr = False, TILES: tl.constexpr = 1):
    """Program (m, c): x'[m] for Hadamard blocks c*CH*TILES .. (c+1)*CH*TILES-1, TILES tiles of CH
    blocks one after another, scaled by 2**e_m, as fp16.

    MMA_ORDER stores each 128-block in decode_wgmma's column order (mma_column_order); with
    HALVES, in the halves codec's order, each value twice (256 columns a block). With PDL
    and RELEASE_EARLY the GEMM that reads x' is released at once, so it can fetch its weights
    while this runs; without RELEASE_EARLY it launches as this kernel's programs exit. With NORM
    the row first goes through the RMSNorm that precedes the layer (weight ``nw``, ``eps``), as
    the model computes it: x * rsqrt(mean(x**2) + eps) in fp32, rounded to x's dtype, times the
    weight, rounded again. FP8 stores e4m3 instead, bounded by 2**8 (not 2**15): with MMA_ORDER in
    decode_fp8's column order, with 2**-e / 16 as the row's factor (decode_fp8's weights are 16 T);
    without, in x's own column order with 2**-e (the dequantize-once paths' library GEMM). BF16
    stores bf16(x') unscaled (no row pass, no factor): the bf16 library GEMM's operand.
    """
    wait_for_producer(PDL)
    release_dependents(PDL and RELEASE_EARLY)
    m = tl.program_id(0)
    pc = tl.program_id(1)
    row = x_ptr + m.to(tl.int64) * stride_xm
    # The program's first [CH, 128] tile is loaded first: nothing it reads waits for the row's
    # reductions, so its latency overlaps theirs.
    j = tl.arange(0, 128)[None, :]
    b = pc * TILES * CH + tl.arange(0, CH)[:, None]
    k = b * 128 + j
    xt = tl.load(row + k * stride_xk, mask=k < K_in, other=0.0).to(tl.float32)
    sv = tl.load(sv_ptr + k, mask=k < Kp, other=0).to(tl.float32)
    # Trip counts are constexpr throughout these kernels: a loop bound read from a runtime
    # argument is not supported by the CPU interpreter with numpy >= 2.4. The loops are unrolled,
    # so the row's loads do not depend on one another and are all in flight at once.
    rstd = 1.0
    if NORM:  # the row's mean square (every program of the row computes the same value)
        ss = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
        for i in tl.static_range(AMAX_STEPS):
            kr = i * AMAX_BLOCK + tl.arange(0, AMAX_BLOCK)
            v = tl.load(row + kr * stride_xk, mask=kr < K_in, other=0.0).to(tl.float32)
            # The forms the rolled loop compiled to (bitwise on an H200): the first square may
            # be fused into the sum's adds, the later ones into the accumulation.
            if i == 0:
                ss += v * v
            else:
                ss = tl.fma(v, v, ss)
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K_in + eps)
    a = 0.0
    scale = 1.0
    if not BF16:
        # The row's max |x| (every program of the row computes the same value).
        amax = tl.zeros([AMAX_BLOCK], dtype=tl.float32)
        nan = tl.zeros([AMAX_BLOCK], dtype=tl.int32)
        for i in tl.static_range(AMAX_STEPS):
            kr = i * AMAX_BLOCK + tl.arange(0, AMAX_BLOCK)
            v = _normed(tl.load(row + kr * stride_xk, mask=kr < K_in, other=0.0).to(tl.float32), nw_ptr, kr,
                        kr < K_in, rstd, NORM, X_DTYPE)
            amax = tl.maximum(amax, tl.abs(v))
            if FP8:  # max() may drop a NaN (on the GPU and in the interpreter): count them
                nan += (v != v).to(tl.int32)
        a = tl.max(amax, axis=0)
        if FP8:  # a row holding a NaN or an infinity reads NaN here: its factor and values are NaN below
            a = tl.where((tl.sum(nan, axis=0) > 0) | (a == float("inf")), float("nan"), a)
        # e = floor(log2(2**15 / (sqrt(128) * amax))) read off the fp32 exponent field, clamped.
        if FP8:  # e4m3: |x' * 2**e| <= 2**8 < 448
            q = 256.0 / (a * SQRT_HAD)
        else:
            q = 32768.0 / (a * SQRT_HAD)
        e = ((q.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
        e = tl.minimum(tl.maximum(e, -64), 64)
        scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
        if pc == 0:
            if FP8 and MMA_ORDER:
                f = ((-e + (127 - DECODE_FP8_SCALE_LOG2)) << 23).to(tl.float32, bitcast=True)  # 2**-e / 16
            else:
                f = ((127 - e) << 23).to(tl.float32, bitcast=True)
            if FP8:  # a non-finite row's factor is NaN too, whatever its e4m3 values carry
                f = tl.where(a != a, float("nan"), f)
            tl.store(inv_ptr + m, f)
    for t in range(TILES):
        if t > 0:  # the next tile of this program's run (the first was loaded above)
            b = (pc * TILES + t) * CH + tl.arange(0, CH)[:, None]
            k = b * 128 + j
            xt = tl.load(row + k * stride_xk, mask=k < K_in, other=0.0).to(tl.float32)
            sv = tl.load(sv_ptr + k, mask=k < Kp, other=0).to(tl.float32)
        _transform_tile(xt, sv, b, k, nw_ptr, xq_ptr, m, rstd, scale, a, Kp, K_in, CH, MMA_ORDER, HALVES, NORM,
                        X_DTYPE, FP8, BF16)


@triton.jit
def _transform_tile(xt, sv, b, k, nw_ptr, xq_ptr, m, rstd, scale, a, Kp, K_in, CH: tl.constexpr,
                    MMA_ORDER: tl.constexpr, HALVES: tl.constexpr, NORM: tl.constexpr, X_DTYPE: tl.constexpr,
                    FP8: tl.constexpr, BF16: tl.constexpr):
    """One [CH, 128] tile of row m (blocks b [CH, 1], columns k, signs sv): x' of its CH Hadamard
    blocks, stored."""
    # CH Hadamard blocks, the rows of the tile, through the butterflies of hadamard128: sign
    # flips and +-1 products are exact, the sums fp32.
    xs = _normed(xt, nw_ptr, k, k < K_in, rstd, NORM, X_DTYPE) * sv
    h = (hadamard128(xs) * INV_SQRT_HAD) * scale
    if BF16:
        tl.store(xq_ptr + m.to(tl.int64) * Kp + k, round_to(h, tl.bfloat16), mask=k < Kp)
    elif FP8:
        # e4m3 has no infinity (a saturating conversion would turn one into 448): a row holding
        # one, or a NaN, reads a = NaN from the row pass and becomes NaN, as its product through
        # the reference does.
        h = tl.where(a != a, float("nan"), h)
        if MMA_ORDER:
            # T column 32 t + 16 u + 8 e + 2 s + h sits at MMA column 32 s + 16 h + 4 t + 2 u + e
            # (decode_fp8.fp8_mma_column_order): bits (t1 t0 u e s1 s0 h) -> (s1 s0 h t1 t0 u e).
            h = tl.reshape(tl.permute(tl.reshape(h, [CH, 2, 2, 2, 2, 2, 2, 2]), (0, 5, 6, 7, 1, 2, 3, 4)),
                           [CH, 128])
        tl.store(xq_ptr + m.to(tl.int64) * Kp + k, round_to(h, tl.float8e4nv), mask=k < Kp)
    elif HALVES:
        # T column 16 q + 8 a + s sits at MMA columns 2 (64 a + 8 s + 4 (q % 2) + q // 2) + e,
        # e = 0, 1 (the weight's low and high halves): bits (c3 c2 c1 c0 q0 q2 q1), then twice.
        h = tl.reshape(tl.permute(tl.reshape(h, [CH, 2, 2, 2, 2, 2, 2, 2]), (0, 4, 5, 6, 7, 3, 1, 2)), [CH, 128])
        k2 = b * 256 + tl.arange(0, 256)[None, :]
        tl.store(xq_ptr + m.to(tl.int64) * (2 * Kp) + k2, round_to(tl.reshape(tl.join(h, h), [CH, 256]), tl.float16),
                 mask=k2 < 2 * Kp)
    else:
        if MMA_ORDER:
            # T column 16 q + c of a 128-block sits at MMA column 16 (c % 8) + 8 (q % 2) + 2 (q // 2)
            # + c // 8 (the inverse of decode_wgmma.mma_column_order): a permutation of the column
            # index's bits, (q2 q1 q0 c3 c2 c1 c0) -> (c2 c1 c0 q0 q2 q1 c3). The tile is permuted in
            # registers and stored contiguously: 16-byte stores, where scattering 2-byte ones cost
            # the kernel up to 4x its time at 64 tokens (H200).
            h = tl.reshape(tl.permute(tl.reshape(h, [CH, 2, 2, 2, 2, 2, 2, 2]), (0, 5, 6, 7, 3, 1, 2, 4)),
                           [CH, 128])
        tl.store(xq_ptr + m.to(tl.int64) * Kp + k, round_to(h, tl.float16), mask=k < Kp)


#: Programs an input transform aims at: one a streaming multiprocessor of an H100/H200 (132).
INPUT_PROGRAMS = 132


def input_blocks_per_program(m: int, blocks: int, parallel: bool = True) -> int:
    """Hadamard blocks one input-transform program takes (1, 2, 4, 8, 16 or 32): where programs run
    in ``parallel`` (compiled kernels) the most that still leave ``INPUT_PROGRAMS`` programs for M
    tokens of ``blocks`` blocks each, at least one. Every program reads its token's whole row for
    the row's max |x| (an L2 hit after the first), so fewer blocks a program means more parallel
    programs for the same few tokens but more redundant row reads: at one token the kernel is
    bound by its programs' latency (one block a program up to 132 blocks); from 16 tokens the
    redundant row reads cost more than the parallelism gains (H200, one program an SM against
    two: 8-20% faster at 16 tokens, within 5% at 64; with the norm, whose row pass is heavier,
    14-36% faster). Triton's CPU interpreter runs programs one after another, so there every
    program takes 16."""
    ch = 32
    while parallel and ch > 1 and m * -(-blocks // ch) < INPUT_PROGRAMS:
        ch //= 2
    return ch if parallel else 16


def input_columns(kp: int, halves: bool = False) -> int:
    """Columns of x' for a weight of padded input width ``kp``: twice as many in the halves
    codec's order, which stores each value twice."""
    return 2 * kp if halves else kp


def check_norm(x2d: torch.Tensor, norm: RowNorm | None, op: str = "") -> None:
    """A one-line ValueError (``op``, when given, named first) unless ``norm`` is None or the input
    transform can apply it to x2d [..., in] (``RowNorm.fusable``). Callers that launch a prepared
    input transform again, which skips ``prepare_input``, call it on every call."""
    if norm is not None and not norm.fusable(x2d):
        raise ValueError(f"{op + ': ' if op else ''}the norm's weight must be a [{x2d.shape[-1]}] {x2d.dtype} tensor "
                         f"on {x2d.device} to be applied in the input transform")


def check_head_norm(y: torch.Tensor, head_norm: HeadNorm | None, np_: int, op: str = "") -> None:
    """``check_norm``'s twin for the output transform: a one-line ValueError (``op``, when given,
    named first) unless ``head_norm`` is None or its weight is [np_] and it can be applied to a y
    like ``y`` (``HeadNorm.fusable``). Callers that launch a prepared output transform again,
    which skips ``prepare_output``, call it on every call."""
    if head_norm is not None and not (head_norm.weight.shape[0] == np_ and head_norm.fusable(y)):
        raise ValueError(f"{op + ': ' if op else ''}the head norm's weight must be a contiguous [{np_}] {y.dtype} "
                         f"tensor on {y.device} and its flags int8, to be applied in the output transform")


def prepare_input(x2d: torch.Tensor, qw: QuantizedWeight, mma_order: bool = False,
                  dependent_launch: bool = False, release_early: bool = False,
                  norm: RowNorm | None = None,
                  keep: bool = True, halves: bool = False,
                  fp8: bool = False, bf16: bool = False, blocks: int | None = None,
                  tiles: int = 1, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None, Prepared | None]:
    """``hadamard_input``, and with ``keep`` its launch prepared to run again (``common.Prepared``;
    per-call tensors ``INPUT_SLOTS``: x, x', 2**-e and the norm's weight, which is x when there is
    none; with ``bf16``, x' stands in for the absent 2**-e).

    ``fp8``: x' * 2**e in e4m3, |x' * 2**e| <= 2**8, with ``mma_order`` in decode_fp8's column
    order and 2**-e / 16 as the row's factor, without in x's column order and 2**-e (the
    dequantize-once paths). ``bf16``: bf16(x'), unscaled, in x's column order, and None for the
    factor. ``halves`` is decode_wgmma's alone. ``blocks`` (Hadamard blocks a tile, a power of two;
    default ``input_blocks_per_program``) and ``tiles`` (tiles a program, one after another)
    shape the grid: [M, ceil(Kp / 128 / (blocks * tiles))]. ``rows`` (>= M): x' is allocated with
    that many rows, those past M left unwritten (a GEMM that reads whole token blocks)."""
    if (fp8 or bf16) and halves:
        raise ValueError("halves is decode_wgmma's fp16 order: it does not apply to fp8 or bf16")
    if fp8 and bf16:
        raise ValueError("fp8 and bf16 are two different outputs: ask for one")
    if bf16 and mma_order:
        raise ValueError("bf16 stores x's own column order: mma_order does not apply")
    if x2d.dim() != 2 or x2d.shape[1] != qw.in_features:
        raise ValueError(f"x2d must be [M, {qw.in_features}], got {list(x2d.shape)}")
    check_norm(x2d, norm)
    m = x2d.shape[0]
    kp = qw.padded_shape[1]
    dtype = FP8_DTYPE if fp8 else torch.bfloat16 if bf16 else torch.float16
    out = torch.empty((max(m, rows or 0), input_columns(kp, halves)), dtype=dtype, device=x2d.device)
    inv_scale = None if bf16 else torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m == 0:
        return out, inv_scale, None
    ch = blocks or input_blocks_per_program(m, kp // HAD_BLOCK, parallel=not interpreted())
    grid = (m, triton.cdiv(kp // HAD_BLOCK, ch * tiles))
    # The row in chunks of up to 8192 inputs, all loaded at once (the loops are unrolled). The
    # chunking also fixes the mean square's summation order, hence the norm's bits: keep it.
    amax_block = min(8192, triton.next_power_of_2(qw.in_features))
    args = (x2d, qw.sv, out, out if bf16 else inv_scale, x2d if norm is None else norm.weight,
            0.0 if norm is None else norm.eps, qw.in_features, kp, x2d.stride(0), x2d.stride(1))
    settings = dict(CH=ch, AMAX_BLOCK=amax_block, AMAX_STEPS=triton.cdiv(qw.in_features, amax_block),
                    MMA_ORDER=mma_order or halves, HALVES=halves, PDL=dependent_launch, RELEASE_EARLY=release_early,
                    NORM=norm is not None,
                    X_DTYPE=TL_DTYPES[x2d.dtype], FP8=fp8, BF16=bf16, TILES=tiles, num_warps=4,
                    launch_pdl=dependent_launch)
    return out, inv_scale, prepare(_input_transform_kernel, grid, *args, slots=INPUT_SLOTS if keep else None,
                                   **settings)


def hadamard_input(x2d: torch.Tensor, qw: QuantizedWeight, mma_order: bool = False,
                   dependent_launch: bool = False, release_early: bool = False,
                   norm: RowNorm | None = None, halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x2d [M, in] (fp16/bf16/fp32, any strides) -> (x' * 2**e as fp16 [M, Kp], 2**-e fp32 [M]).

    x' = Hk (sv * pad(x)) row by row, as escha.format.input_transform, scaled per row by a power of
    two (module docstring). ``mma_order`` stores each 128-block in decode_wgmma's column order;
    ``dependent_launch`` launches as a programmatic dependent (common.dependent_launch_supported);
    ``release_early`` then lets the next kernel launch at once rather than as this one's programs exit.
    ``norm`` (its weight of x's dtype) applies the RMSNorm before the layer first (``RowNorm.fusable``).
    ``halves`` stores the halves codec's order instead (decode_wgmma's HALVES): each value twice,
    [M, 2 Kp].
    """
    return prepare_input(x2d, qw, mma_order, dependent_launch, release_early, norm, keep=False, halves=halves)[:2]


@triton.jit
def _output_rows(z, m, n, nb, rs, M, N_out, inv_ptr, hw_ptr, hb_ptr, heps, y_ptr, stride_ym,
                 HEAD_NORM: tl.constexpr):
    """y[m, n] = crop((z H) * rs * 2**-e[m]) for the summed partials z [rows, 128] of tokens m
    (a column) and the 128-row block nb (n, a row), with the head norm where ``hb`` flags nb."""
    mmask = m < M
    # z H in fp32 butterflies (hadamard128): exact +-1 products, 7 fp32 roundings a value.
    h = hadamard128(z) * INV_SQRT_HAD
    inv = tl.load(inv_ptr + m, mask=mmask, other=0.0)
    y = h * rs * inv
    if HEAD_NORM:
        OUT: tl.constexpr = y_ptr.dtype.element_ty
        yr = round_to(y, OUT).to(tl.float32)  # the projection's output, as the model's norm reads it
        # The mean square by a fixed tree (row_sum128: the same bits for any BM and warps). A bf16
        # or fp16 yr squares exactly in fp32, so a multiply fused into the first add rounds the same.
        rstd = tl.rsqrt(row_sum128(yr * yr) / 128.0 + heps)
        w = tl.load(hw_ptr + n).to(tl.float32)
        yn = round_to(w * round_to(yr * rstd, OUT).to(tl.float32), OUT).to(tl.float32)
        y = tl.where(tl.load(hb_ptr + nb) != 0, yn, y)
    tl.store(y_ptr + m * stride_ym + n, round_to(y, y_ptr.dtype.element_ty), mask=mmask & (n < N_out))


@triton.jit
def _output_transform_kernel(z_ptr, y_ptr, scale_ptr, su_ptr, gscale_ptr, inv_ptr, hw_ptr, hb_ptr, seg_ptr, heps,
                             M, N_out, stride_zs, stride_zm, stride_ym,
                             SPLIT: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr, HEAD_NORM: tl.constexpr,
                             PAIRED: tl.constexpr):
    """Program (nb, mb): y[mb*BM.., nb*128..] = crop((H sum_s z[s]) * g*c*su * 2**-e) in y's dtype.

    z: fp32 partials [SPLIT, >= M, Np] (rows from M on are not read), or with PAIRED int32 words
    [SPLIT, >= M/2, Np] whose low and high halves are the bf16 partials of tokens 2i and 2i + 1
    (``decode_fp8``'s: a program's BM tokens are its BM/2 word rows, read as wide as fp32 rows;
    a pair's second token past M is read and goes nowhere); unit stride along Np either way.

    The partials are summed in the fixed order s = 0, 1, ..., so the result is bitwise
    reproducible; rows of 64-row group r take the first seg[r] of the SPLIT partials (the GEMM
    wrote no others there). With PDL the weight's own data (H, row scales, segment counts) is
    read while the GEMM finishes; z and 2**-e only after it. With HEAD_NORM, a block flagged in ``hb`` is one attention
    head, normalised as the model's per-head RMSNorm does it (escha.norm.HeadNorm): the program
    holds the whole head of each of its tokens.
    """
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    n = nb * 128 + tl.arange(0, 128)[None, :]
    rs = row_scale_block(scale_ptr, su_ptr, gscale_ptr, n, n < N_out)
    seg = tl.load(seg_ptr + n // 64)
    wait_for_producer(PDL)
    if PAIRED:
        i = mb * (BM // 2) + tl.arange(0, BM // 2)[:, None]  # word rows: tokens 2i and 2i + 1
        lo = tl.zeros([BM // 2, 128], dtype=tl.float32)
        hi = tl.zeros([BM // 2, 128], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            w = tl.load(z_ptr + s * stride_zs + i * stride_zm + n, mask=(2 * i < M) & (s < seg), other=0)
            lo += (w << 16).to(tl.float32, bitcast=True)  # a bf16's bits are an fp32's top half
            hi += (w & -65536).to(tl.float32, bitcast=True)
        _output_rows(lo, 2 * i, n, nb, rs, M, N_out, inv_ptr, hw_ptr, hb_ptr, heps, y_ptr, stride_ym, HEAD_NORM)
        _output_rows(hi, 2 * i + 1, n, nb, rs, M, N_out, inv_ptr, hw_ptr, hb_ptr, heps, y_ptr, stride_ym,
                     HEAD_NORM)
    else:
        m = mb * BM + tl.arange(0, BM)[:, None]
        z = tl.zeros([BM, 128], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            z += tl.load(z_ptr + s * stride_zs + m * stride_zm + n, mask=(m < M) & (s < seg), other=0.0)
        _output_rows(z, m, n, nb, rs, M, N_out, inv_ptr, hw_ptr, hb_ptr, heps, y_ptr, stride_ym, HEAD_NORM)


#: Output-transform programs the rule aims at: about four an SM of an H100/H200 (132).
OUTPUT_PROGRAMS = 512


def output_shape(m: int, np_: int, parallel: bool = True) -> tuple[int, int]:
    """(tokens, warps) a program of the output transform for m tokens of an Np-row weight: 4 warps
    and the most tokens (a power of two, at most 16, no more than m rounded up) that still give
    OUTPUT_PROGRAMS programs over the Np/128 row blocks, else one token a program (H200,
    benchmarks/results/transform_shapes_h200/: fewer rows a program took 1-4% off a call at 8-16
    tokens on the narrow projections, where 16 rows a program left 40 programs). Where programs
    do not run in ``parallel`` (Triton's CPU interpreter runs them one after another) the most
    tokens."""
    t = min(16, triton.next_power_of_2(m))
    while parallel and t > 1 and (np_ // HAD_BLOCK) * triton.cdiv(m, t) < OUTPUT_PROGRAMS:
        t //= 2
    return t, 4


def hadamard_output(z: torch.Tensor, qw: QuantizedWeight, inv_scale: torch.Tensor, out: torch.Tensor,
                    dependent_launch: bool = False, head_norm: HeadNorm | None = None,
                    segments: torch.Tensor | None = None, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """Sum split partials z [SPLIT, Mz, Np] (fp32; or int32 words [SPLIT, Mz/2, Np] holding the bf16
    partials of two tokens each, ``decode_fp8``'s) in order, apply Hn, g*c*su, 2**-e; write out [M, out].

    ``out`` is preallocated in the output dtype (fp16, bf16 or fp32) with unit column stride; z,
    with unit stride along Np, may hold more rows than out (Mz >= M: a GEMM's rows rounded up),
    which are not read.
    ``dependent_launch``: launched as a programmatic dependent of the GEMM that writes z.
    ``head_norm``: the per-head RMSNorm of the flagged blocks (weight of out's dtype, heads whole
    inside the output), applied before the store.
    ``segments``: int32 [Np/64], how many of the partials (the first ones) hold a part of each
    64-row group; the others are not read (None: all SPLIT everywhere).
    ``shape``: (tokens, warps) a program (tokens a power of two; default ``output_shape``); the
    shape moves no bit of the result.
    """
    prepare_output(z, qw, inv_scale, out, dependent_launch, head_norm, segments, keep=False, shape=shape)
    return out


def prepare_output(z: torch.Tensor, qw: QuantizedWeight, inv_scale: torch.Tensor, out: torch.Tensor,
                   dependent_launch: bool = False, head_norm: HeadNorm | None = None,
                   segments: torch.Tensor | None = None, keep: bool = True,
                   shape: tuple[int, int] | None = None) -> Prepared | None:
    """``hadamard_output``, returning with ``keep`` its launch prepared to run again
    (``common.Prepared``; per-call tensors ``OUTPUT_SLOTS``: z, out, 2**-e and the head norm's
    weight and flags, which are out when there is none), else None."""
    split, zm, np_ = z.shape
    m = out.shape[0]
    bm, warps = shape or output_shape(m, np_, parallel=not interpreted())
    if bm < 1 or bm & (bm - 1) or warps not in (1, 2, 4, 8):
        raise ValueError(f"shape must be (tokens a power of two, warps 1/2/4/8), got {shape}")
    paired = z.dtype == torch.int32
    if (np_ != qw.padded_shape[0] or zm * (2 if paired else 1) < m or out.dim() != 2
            or out.shape[1] != qw.out_features or out.stride(1) != 1 or z.stride(2) != 1
            or z.dtype not in (torch.float32, torch.int32)):
        raise ValueError(f"bad shapes: z {z.dtype} {list(z.shape)}, out {list(out.shape)} for weight {qw.shape}")
    bm = max(bm, 2) if paired else bm  # a program takes whole word rows
    if segments is None:
        segments = constant_vector(z.device, np_ // 64, split, torch.int32)  # every partial counts
    elif segments.shape != (np_ // 64,) or segments.dtype != torch.int32 or segments.device != z.device:
        raise ValueError(f"segments must be int32 [{np_ // 64}] on {z.device}, got {segments.dtype} "
                         f"{list(segments.shape)} on {segments.device}")
    check_head_norm(out, head_norm, np_, "hadamard_output")
    grid = (np_ // HAD_BLOCK, triton.cdiv(m, bm))
    hw, hb = (out, out) if head_norm is None else (head_norm.weight, head_norm.blocks)
    args = (z, out, qw.scale, qw.su, qw.gscale, inv_scale, hw, hb, segments,
            0.0 if head_norm is None else head_norm.eps, m, qw.out_features, z.stride(0), z.stride(1), out.stride(0))
    settings = dict(SPLIT=split, BM=bm, PDL=dependent_launch, HEAD_NORM=head_norm is not None, PAIRED=paired,
                    num_warps=warps, launch_pdl=dependent_launch)
    return prepare(_output_transform_kernel, grid, *args, slots=OUTPUT_SLOTS if keep else None, **settings)


@triton.jit
def _output_hadamard_kernel(z_ptr, h_ptr, y_ptr, scale_ptr, su_ptr, gscale_ptr, M, N_out, stride_zm, stride_ym,
                            BM: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Program (nb, mb): y[mb*BM.., nb*128..] = crop((z H) * g*c*su / sqrt(128)) in y's dtype.

    z is one [M, Np] product in a 16-bit dtype (a library GEMM's output), so z and +-1 are exact
    operands and the tensor core sums their products in fp32: one product, no split pieces.
    """
    nb = tl.program_id(0)
    mb = tl.program_id(1)
    m = mb * BM + tl.arange(0, BM)[:, None]
    n = nb * 128 + tl.arange(0, 128)[None, :]
    mmask = m < M
    hm = load_hadamard(h_ptr)
    rs = row_scale_block(scale_ptr, su_ptr, gscale_ptr, n, n < N_out) * INV_SQRT_HAD
    z = tl.load(z_ptr + m.to(tl.int64) * stride_zm + n, mask=mmask, other=0.0)
    y = tl.dot(z.to(DOT_DTYPE), hm) * rs
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, round_to(y, y_ptr.dtype.element_ty),
             mask=mmask & (n < N_out))


def hadamard_output_dense(z: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """Apply Hn and g*c*su to one 16-bit product z [M, Np] (fp16/bf16, unit column stride) and
    write the cropped result to ``out`` [M, out_features] (fp16, bf16 or fp32, unit column stride).

    The output side of a GEMM whose weight operand is the plain core T (``dequant_core_fp8``).
    """
    m, np_ = z.shape
    if np_ != qw.padded_shape[0] or z.dtype not in (torch.float16, torch.bfloat16) or z.stride(1) != 1:
        raise ValueError(f"z must be fp16/bf16 [M, {qw.padded_shape[0]}] with unit column stride, "
                         f"got {z.dtype} {list(z.shape)} stride {z.stride()}")
    if out.shape != (m, qw.out_features) or out.stride(1) != 1:
        raise ValueError(f"out must be [{m}, {qw.out_features}] with unit column stride, got {list(out.shape)}")
    prepare_output_dense(z, qw, out, keep=False)
    return out


def prepare_output_dense(z: torch.Tensor, qw: QuantizedWeight, out: torch.Tensor, keep: bool) -> Prepared | None:
    """``hadamard_output_dense`` (operands checked by the caller) and, with ``keep``, its launch
    prepared to run again (slots ``z_ptr``, ``y_ptr``), else None."""
    m, np_ = z.shape
    bm = 64
    ddt = dot_dtype(z.dtype)
    grid = (np_ // HAD_BLOCK, triton.cdiv(m, bm))
    args = (z, hadamard_operand(z.device, ddt), out, qw.scale, qw.su, qw.gscale, m, qw.out_features, z.stride(0),
            out.stride(0))
    return prepare(_output_hadamard_kernel, grid, *args, slots=("z_ptr", "y_ptr") if keep else None, BM=bm,
                   DOT_DTYPE=ddt, num_warps=4)


# -- A call's three launches kept ----------------------------------------------------------------
class KeptPlan(NamedTuple):
    """The three launches of a decode call, kept prepared: ``prepare_input``'s, the GEMM's (its
    per-call arguments: x''s operand and the partials) and ``prepare_output``'s; ``segments`` is
    the partials' first dimension."""
    segments: int
    input: Prepared
    gemm: Prepared
    output: Prepared


def plan_key(op: str, qw: QuantizedWeight, x2d: torch.Tensor, config: object, norm: RowNorm | None,
             head_norm: HeadNorm | None, out: torch.Tensor | None) -> tuple:
    """The key of a call's ``KeptPlan``: everything its prepared launches fixed (the op, the
    weight's other tensors, x's dtype, strides and alignment, the configuration, the norms'
    dtypes, alignment and eps, a caller's output buffer's stride and alignment)."""
    return (op, id(qw.su), id(qw.sv), id(qw.scale), id(qw.gscale), x2d.shape[0], x2d.dtype, x2d.stride(0),
            x2d.stride(1), x2d.data_ptr() % 16 == 0, config,
            None if norm is None else (norm.weight.dtype, norm.weight.data_ptr() % 16 == 0, norm.eps),
            None if head_norm is None else (head_norm.weight.dtype, head_norm.weight.data_ptr() % 16 == 0,
                                            head_norm.blocks.data_ptr() % 16 == 0, head_norm.eps),
            None if out is None else (out.stride(0), out.data_ptr() % 16 == 0))


def run_kept(plan: KeptPlan, key: tuple, graphs: dict, x2d: torch.Tensor, out: torch.Tensor | None,
             norm: RowNorm | None, head_norm: HeadNorm | None, parts: Callable[[], Parts],
             x_operand: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """y [M, out_features] of a call whose launches ``plan`` keeps under ``key`` (``plan_key``).

    Eager calls replay the plan as one CUDA graph kept in ``graphs`` (``common.replayed``); inside
    a capture, into a caller's ``out``, from x with rows not contiguous, on a key's first call on
    a stream or past the graphs' bound, the three launches run again over fresh tensors.
    ``parts()`` lists the call's x, x', 2**-e, partials and y (``common.replayed``);
    ``x_operand(x')`` is the GEMM's argument for x' (a TMA descriptor)."""
    def launch(x_, xq, inv, ws, y_):
        plan.input.run(x_, xq, inv, x_ if norm is None else norm.weight)
        plan.gemm.run(x_operand(xq), ws)
        plan.output.run(ws, y_, inv, *((y_, y_) if head_norm is None else (head_norm.weight, head_norm.blocks)))

    if replayable(x2d, out):
        # The graph fixes the norms' addresses: they are part of its key.
        gkey = (key, None if norm is None else norm.weight.data_ptr(),
                None if head_norm is None else (head_norm.weight.data_ptr(), head_norm.blocks.data_ptr()))
        y = replayed(graphs, gkey, x2d, parts, launch)
        if y is not None:
            return y
    _, xq_part, inv_part, ws_part, (y_shape, _) = parts()
    xq, inv, ws = (torch.empty(shape, dtype=dtype, device=x2d.device) for shape, dtype in (xq_part, inv_part, ws_part))
    y = output_tensor(x2d, y_shape[0], y_shape[1], out)
    launch(x2d, xq, inv, ws, y)  # x' rows past M and the partials left unwritten: the counts say which
    return y


# -- Why the launch shapes are what they are -----------------------------------------------------
# Measured on one H200 (torch 2.11+cu130, triton 3.6.0), the whole register-operand decode call in
# CUDA graphs, weights rotated past L2, median of 5 rounds in one process
# (bench_decode_wgmma.py --transform-variants; benchmarks/results/transform_shapes_h200/).
# Output transform: 16 tokens a program left 40 programs on a 5120-row weight at 8-16 tokens; the
# most tokens that still leave OUTPUT_PROGRAMS programs took 1.1-4.2% off the call at 8-16 tokens
# and -3.0% to +0.5% at 32-64 in three runs over four shapes (down 5120x8704 at 16 tokens: 23.5
# against 24.3 us; Llama-3-8B down: 27.3 against 28.2). One or two warps
# a program were never faster than four beyond noise.
# Input transform: aiming the decode call's input transform at 64 programs instead of
# INPUT_PROGRAMS gained at most 1.4% at 8-16 tokens and lost up to 2.8% at 32-64 (run 3): the
# rule stays.
