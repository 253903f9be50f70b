"""Dequantize-once scratch filler for Hopper: the Triton kernel's product, software-pipelined in Gluon.

Fills the same scratch as ``dequant_once.dequant_hn`` (bit for bit: e4m3(Hn_pm1 T / 2) with the
row scales, or bf16(r * Hn T)), for the same GEMM. Why a second kernel: in the Triton kernel
every step waits for its own tensor-core product before it decodes the next block (Triton 3.6
places ``wgmma.wait_group 0`` right after a product whose operand was computed in registers;
docs/KERNELS.md), so the codec, the product and the stores run in series. Here one warpgroup pair
issues block i's product asynchronously and, while it runs, writes block i-1 out and decodes
block i+1:

    decode(0); store T(0); issue MMA(0)
    for i in 1..n-1:  decode(i) [MMA(i-1) runs] | store T(i) | issue MMA(i) | wait for MMA(i-1) |
                      write out block i-1 [MMA(i) runs]
    wait for MMA(n-1); write out block n-1

(unrolled, so that the two accumulators never move between registers). The wait keeps one
group in flight (wait_group 1): ptxas moves a wait for everything (wait_group 0) up to the start
of the step, ahead of the decode, which would serialize them again.

S [128 rows, BK] = (HN_FP8_SCALE * H)[128, 128] @ T[128, BK]: A is the +-1/2 matrix in shared
memory (loaded once a program), B the decoded block in shared memory (two buffers: block i is
stored while MMA(i-1) reads the other), fp32 accumulator in registers. Eight
warps, so each warpgroup owns 64 of the 128 rows and an accumulator is 32 registers a thread.

The words come from ``decode_wgmma.packed_words`` (64-bit row windows, the register-operand
decode's cached repack), so K = 2 and 3 decode alike: state c of a tile row is
(v >> (48 - K c)) & 0xFFFF of its 64-bit window v.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ..format.qweight import QuantizedWeight
from ..format.spec import HAD_BLOCK
from .common import HN_FP8_SCALE, INV_SQRT_HAD, check_codebook, hadamard_operand
from .decode_wgmma import SUPPORTED_BITS, _iota, _state_values, packed_words, runs_on


# -- device code ------------------------------------------------------------------------------

@gluon.jit
def _load_h(h_ptr, L2: gl.constexpr):
    """The [128, 128] HN_FP8_SCALE * H matrix from global memory, in layout L2."""
    i = gl.arange(0, 128, layout=gl.SliceLayout(1, L2))
    j = gl.arange(0, 128, layout=gl.SliceLayout(0, L2))
    return gl.load(h_ptr + i[:, None] * 128 + j[None, :])


@gluon.jit
def _load_windows(words_ptr, nb, kb, NKB128, BK: gl.constexpr, WL: gl.constexpr):
    """int32 [128 rows, BK/16 tiles, 2] (hi, lo) row windows of rows 128 nb.. and k block kb (BK wide).

    ``pack_words`` orders a (128-row, 128-column) block's 2048 words as [fragment f, warp w,
    row half mh, g, t, tile half h, hi/lo j] for row 64 f + 16 w + 8 mh + g and tile 2 t + h.
    """
    TB: gl.constexpr = BK // 16
    n = _iota(128, 0, 3, WL)
    tt = _iota(TB, 1, 3, WL)
    j = _iota(2, 2, 3, WL)
    tile = (kb * TB) % 8 + tt  # tile within the 128-column block
    off = (((n // 64) * 4 + (n // 16) % 4) * 2 + (n // 8) % 2) * 128 + ((n % 8) * 4 + tile // 2) * 4 + (tile % 2) * 2 + j
    block = (nb * NKB128 + (kb * TB) // 8).to(gl.int64) * 2048
    return gl.load(words_ptr + block + off)


@gluon.jit
def _decode_block(w, BITS: gl.constexpr, BK: gl.constexpr, DL: gl.constexpr):
    """fp16 T[128 rows, BK] (natural column order) from the row windows ``w`` of _load_windows.

    DL views the block as [row, tile, pair p]: columns 2p and 2p + 1 of a tile are decoded
    together (two states per codec call), and joining them puts column 16 tile + 2p + e last.
    """
    TB: gl.constexpr = BK // 16
    W2: gl.constexpr = gl.SliceLayout(2, DL)
    hi, lo = gl.split(w)
    hi = gl.expand_dims(gl.convert_layout(hi, W2), 2).to(gl.uint32, bitcast=True)
    lo = gl.expand_dims(gl.convert_layout(lo, W2), 2).to(gl.uint32, bitcast=True)
    v = (hi.to(gl.uint64) << 32) | lo.to(gl.uint64)  # [128, TB, 1]
    p = _iota(8, 2, 3, DL).to(gl.uint64)
    sa = ((v >> (48 - BITS * 2 * p)) & 0xFFFF).to(gl.uint32)
    sb = ((v >> (48 - BITS * (2 * p + 1))) & 0xFFFF).to(gl.uint32)
    va, vb = _state_values(sa, sb)
    return gl.reshape(gl.join(va, vb), [128, BK])


@gluon.jit
def _write_block(acc, w_ptr, stride_w, nb, kb, r, BK: gl.constexpr, OUT_FP8: gl.constexpr, OL: gl.constexpr):
    """Round block kb of the scratch (e4m3, or bf16 times the row scales r) and store it."""
    rows = nb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, OL))
    cols = kb * BK + gl.arange(0, BK, layout=gl.SliceLayout(0, OL))
    ptrs = w_ptr + rows[:, None].to(gl.int64) * stride_w + cols[None, :]
    if OUT_FP8:
        gl.store(ptrs, gl.convert_layout(acc.to(gl.float8e4nv), OL))
    else:
        gl.store(ptrs, gl.convert_layout((acc * r[:, None]).to(gl.bfloat16), OL))


@gluon.jit
def _dequant_wgmma_kernel(words_ptr, h_ptr, scale_ptr, su_ptr, gscale_ptr, w_ptr, wscale_ptr, stride_w, Np,
                          NKB128, BITS: gl.constexpr, BK: gl.constexpr, K_PER_PROG: gl.constexpr,
                          OUT_FP8: gl.constexpr):
    """Rows [128 nb, +128) and k blocks [K_PER_PROG pid_k, +K_PER_PROG) (BK wide) of the scratch."""
    nb = gl.program_id(0)
    pid_k = gl.program_id(1)
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1], instr_shape=[16, BK, 16])
    HL: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [8, 1], [1, 0])
    WL: gl.constexpr = gl.BlockedLayout([1, 1, 2], [8, 4, 1], [8, 1, 1], [2, 1, 0])
    DL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [8, 1, 1], [2, 1, 0])
    OL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (BK // 16), BK // 16], [8, 1], [1, 0])

    h_smem = gl.allocate_shared_memory(gl.float16, [128, 128], gl.NVMMASharedLayout.get_default_for(
        [128, 128], gl.float16), _load_h(h_ptr, HL))
    t_smem = gl.allocate_shared_memory(gl.float16, [2, 128, BK], gl.NVMMASharedLayout.get_default_for(
        [128, BK], gl.float16))

    # Row scales g * c * su, multiplied in escha.format.row_scale's order, times 1/(sqrt(128) HN_FP8_SCALE).
    rows = nb * 128 + gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
    ok = rows < Np
    r = (gl.load(gscale_ptr) * gl.load(scale_ptr + rows, mask=ok, other=0.0).to(gl.float32)
         * gl.load(su_ptr + rows, mask=ok, other=0).to(gl.float32)) * (INV_SQRT_HAD / HN_FP8_SCALE)
    if OUT_FP8:
        if pid_k == 0:
            gl.store(wscale_ptr + rows, r)

    kb0 = pid_k * K_PER_PROG
    # Block i: decode into registers while MMA(i-1) runs, store it to buffer i % 2 (MMA(i-2), its
    # last reader, has completed), issue MMA(i), wait until only MMA(i) is in flight, write block
    # i-1 out. Two accumulators, A for even blocks and B for odd ones, and the steps unrolled, so
    # that no register copy touches an accumulator while its product is in flight (a loop would
    # carry one across its back edge; ptxas then serializes the MMAs: warnings C7514/C7515).
    # use_acc=False ignores an accumulator's old values.
    acc_b = gl.zeros([128, BK], dtype=gl.float32, layout=MMA)
    t_smem.index(0).store(_decode_block(_load_windows(words_ptr, nb, kb0, NKB128, BK, WL), BITS, BK, DL))
    fence_async_shared()
    acc_a = warpgroup_mma(h_smem, t_smem.index(0), acc_b, use_acc=False, is_async=True)
    for i in gl.static_range(1, K_PER_PROG):
        t = _decode_block(_load_windows(words_ptr, nb, kb0 + i, NKB128, BK, WL), BITS, BK, DL)
        if i % 2 == 1:
            t_smem.index(1).store(t)
            fence_async_shared()
            acc_b = warpgroup_mma(h_smem, t_smem.index(1), acc_b, use_acc=False, is_async=True)
            acc_a = warpgroup_mma_wait(num_outstanding=1, deps=(acc_a,))
            _write_block(acc_a, w_ptr, stride_w, nb, kb0 + i - 1, r, BK, OUT_FP8, OL)
        else:
            t_smem.index(0).store(t)
            fence_async_shared()
            acc_a = warpgroup_mma(h_smem, t_smem.index(0), acc_a, use_acc=False, is_async=True)
            acc_b = warpgroup_mma_wait(num_outstanding=1, deps=(acc_b,))
            _write_block(acc_b, w_ptr, stride_w, nb, kb0 + i - 1, r, BK, OUT_FP8, OL)
    if (K_PER_PROG - 1) % 2 == 0:
        acc_a = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a,))
        _write_block(acc_a, w_ptr, stride_w, nb, kb0 + K_PER_PROG - 1, r, BK, OUT_FP8, OL)
    else:
        acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_b,))
        _write_block(acc_b, w_ptr, stride_w, nb, kb0 + K_PER_PROG - 1, r, BK, OUT_FP8, OL)


# -- launcher ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class DequantWgmmaConfig:
    """Launch parameters of the pipelined scratch filler (``dequant_wgmma_config`` is the rule)."""

    block_k: int  # columns per step (the wgmma N)
    k_per_prog: int  # steps per program, at most (the launcher takes the largest divisor)


def dequant_wgmma_config(qw: QuantizedWeight, m: int, device: torch.device | None = None) -> DequantWgmmaConfig:
    """The rule: 64 columns a step, up to 8 steps a program (the Triton kernel's tiling; not yet
    measured on a GPU). M does not change the choice."""
    return DequantWgmmaConfig(block_k=64, k_per_prog=8)


def dequant_hn_wgmma(qw: QuantizedWeight, *, fp8: bool = True, config: DequantWgmmaConfig | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dequant_once.dequant_hn`` on Hopper: the same scratch, bit for bit, in the same workspace."""
    from .dequant_once import k_per_prog_for, scratch
    check_codebook(qw, "dequant_hn_wgmma")
    if qw.bits not in SUPPORTED_BITS:
        raise ValueError(f"dequant_hn_wgmma handles K in {SUPPORTED_BITS}, got K={qw.bits}")
    cfg = config or dequant_wgmma_config(qw, 1)
    np_, kp = qw.padded_shape
    dev = qw.device
    w, ws = scratch(qw, fp8)
    kb_total = kp // cfg.block_k
    kpp = k_per_prog_for(kb_total, cfg.k_per_prog)
    h = hadamard_operand(dev, gl.float16, HN_FP8_SCALE.value)
    _dequant_wgmma_kernel[(np_ // HAD_BLOCK, kb_total // kpp)](
        packed_words(qw), h, qw.scale, qw.su, qw.gscale, w, ws if fp8 else w, w.stride(0), np_, kp // HAD_BLOCK,
        BITS=qw.bits, BK=cfg.block_k, K_PER_PROG=kpp, OUT_FP8=fp8, num_warps=8)
    return w, ws


__all__ = ["DequantWgmmaConfig", "dequant_wgmma_config", "dequant_hn_wgmma", "runs_on"]

# Configuration note. Not yet run on a GPU: the tiling copies the Triton kernel's (BK = 64, 8
# steps a program, 1360 programs on gate_up), with 8 warps so that two accumulators (the one in
# flight and the one being written) take 64 registers a thread. To be measured against
# dequant_once's kernel (benchmarks/bench_prefill.py, part-dequant arms).
