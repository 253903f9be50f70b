"""Does a warp-specialized fused fp8 decode GEMM beat escha's mid-range and prefill paths?

``probe_fused_fp8.cu``: one producer warpgroup decodes the trellis into e4m3(64 T) tiles in
shared memory while two consumer warpgroups run fp8 wgmma (m64n256k32) on them against x' tiles
brought by TMA; 128 weight rows x 256 tokens a program, the plain-core contract of
``dequant_core_fp8`` (x' e4m3 with per-token scales from ``actquant``, z = bf16(x' (64 T)^T xscale
/ 64), then ``hadamard_output_dense``). Each weight is decoded once per 256 tokens, with the decode
beside the MMAs instead of before them (the design in docs/KERNELS.md, "The mid range").

This probe builds it with nvcc for sm_90a (and a DUMP_CORE build that also writes its decoded
tiles out), launches it through the CUDA driver API (``probe_cuda_loop.Driver``), and:

- gates it: the decoded tiles bit for bit against ``dequantize_core(qw, e4m3)`` (the DUMP_CORE
  build, NaN-poisoned output), and the whole product against fp64 within the fp8 paths' bound;
- builds it also with two producer warpgroups beside consumers of 128 tokens (``_p2n128``: at
  512 threads a program every thread has 128 registers, which only 64-accumulator consumers fit),
  to see whether the decode's rate grows with its warps;
- times, at each token count: escha.matmul's rule, the plain-core path (``dequant_core_fp8``),
  the fp8 decode GEMM (``decode_fp8``, to 512 tokens), the fused call (actquant, the fused
  kernel, the output pass) and the fused kernel alone, beside cuBLAS bf16 and fp8 (operands
  already e4m3); up to a build's token block also one wave of its programs alone
  (``fused_gemm_wave``, the first row blocks only: the time of one round of a grid that takes more
  than one). One process, weights rotated past L2, one CUDA graph an arm, interleaved rounds,
  median.

Nothing in the library changes. ``nvcc`` must be on PATH (the H200 image has 13.0).

    python benchmarks/probe_fused_fp8.py --out DIR [--ms 128,256,512,1024,2048] [--shapes gate_up,down]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import sys
import tempfile
import traceback

import torch

import escha
from escha.bench.cuda_timing import GraphTimer
from escha.kernels.actquant import actquant
from escha.kernels.decode_fp8 import decode_fp8
from escha.kernels.decode_wgmma import row_windows
from escha.kernels.dequant import dequantize_core
from escha.kernels.dequant_once import dequant_core_fp8
from escha.kernels.transforms import hadamard_output_dense

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import weight_set
from bench_decode_wgmma import (
    SHAPES,
    cublas_arms,
    dense_weights,
    fp8_weights,
    rel_err,
    start_run,
    time_arms,
)
from probe_cuda_loop import _I32, _SWIZZLE_128B, _SWIZZLE_NONE, _U8, Driver, nvcc_cubin

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe_fused_fp8.cu")
BM, STAGES, WSTAGES = 128, 3, 4
WIN_BYTES = BM // 16 * 8 * 128  # a k-block's row windows for the program's rows
# The builds timed: arm suffix -> (tokens a program BN, producer warpgroups). "" is the design
# (one producer warpgroup, 256 tokens: 168 registers); "_p2n128" has two producer warpgroups,
# which fit in the registers (128 a thread at 512 threads) only beside 128-token consumers.
VARIANTS = {"": (256, 1), "_p2n128": (128, 2)}


@dataclasses.dataclass(frozen=True)
class Build:
    """One build of the kernel: its function, tokens a program, threads and shared memory."""

    fn: object
    bn: int
    threads: int
    smem: int


def build_variant(drv: Driver, tmp: str, bn: int, producers: int, dump: bool) -> tuple[Build, str]:
    """The kernel built for sm_90a at (bn, producers), with DUMP_CORE if ``dump``, loaded."""
    defines = (f"-DBN={bn}", f"-DPRODUCERS={producers}") + (("-DDUMP_CORE",) if dump else ())
    cubin, usage = nvcc_cubin(SOURCE, defines, os.path.join(tmp, f"fused_{bn}_{producers}_{int(dump)}.cubin"))
    smem = STAGES * (BM * 128 + bn * 128) + WSTAGES * WIN_BYTES + (2 * STAGES + WSTAGES) * 8 + 1024
    return Build(drv.function(cubin, "fused_fp8_kernel", smem), bn, 128 * (producers + 2), smem), usage


FP8_TOL = 0.077  # the fp8 paths' bound on the whole call against fp64 (tests/test_decode_fp8.py)


class Windows:
    """A weight set's row windows and their TMA maps, made once and shared by every build's
    launches: [TN, TK, 16, 2] int32 viewed as [TN, TK * 32], a k-block's box 8 row tiles x 256."""

    def __init__(self, drv: Driver, weights: list) -> None:
        self.weights = weights
        self.tensors = [row_windows(w.trellis, w.bits).contiguous() for w in weights]
        self.maps = [drv.tensor_map(v.view(v.shape[0], -1), _I32, (256, BM // 16), _SWIZZLE_NONE)
                     for v in self.tensors]


class Fused:
    """The fused kernel's launches of one build over a weight set's windows: ``gemm(i, xq, xscale)``
    writes z for weight i; ``__call__(i, x)`` is the whole call (actquant, the kernel, the output
    pass). With ``core`` (a DUMP_CORE build) the kernel also writes its decoded tiles there."""

    def __init__(self, drv: Driver, build: Build, windows: Windows, core: torch.Tensor | None = None) -> None:
        self.drv, self.build, self.windows, self.core = drv, build, windows, core
        self.weights = windows.weights

    def gemm(self, i: int, xq: torch.Tensor, xscale: torch.Tensor, z: torch.Tensor | None = None,
             programs: int | None = None) -> torch.Tensor:
        """z for weight i (``programs``: only the first row blocks, one program each; timing only)."""
        qw = self.weights[i]
        np_, kp = qw.padded_shape
        m = xq.shape[0]
        if z is None:
            z = torch.empty((m, np_), dtype=torch.bfloat16, device=xq.device)
        b = self.build
        x_map = self.drv.tensor_map(xq.view(torch.uint8), _U8, (128, b.bn), _SWIZZLE_128B)
        args = [x_map, self.windows.maps[i]] + [ctypes.c_uint64(t.data_ptr()) for t in (xscale, z)]
        args += [ctypes.c_uint64(0 if self.core is None else self.core.data_ptr())]
        args += [ctypes.c_int32(v) for v in (m, np_, kp)]
        self.drv.launch(b.fn, (min(np_ // BM, programs or np_), -(-m // b.bn)), b.threads, b.smem, args)
        return z

    def __call__(self, i: int, x: torch.Tensor) -> torch.Tensor:
        qw = self.weights[i]
        xq, xscale = actquant(x, qw, fp8=True)
        z = self.gemm(i, xq, xscale)
        y = torch.empty((x.shape[0], qw.out_features), dtype=x.dtype, device=x.device)
        return hadamard_output_dense(z, qw, y)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="128,256,512,1024,2048")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--gate-only", action="store_true", help="gates, no timing (for compute-sanitizer)")
    args = ap.parse_args()
    log, results = start_run(args.out, "probe_fused_fp8.log")
    torch.zeros(1, device="cuda")  # the primary context, current for the driver calls
    drv = Driver()
    builds, dumps = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for suffix, (bn, producers) in VARIANTS.items():
            builds[suffix], usage = build_variant(drv, tmp, bn, producers, False)
            dumps[suffix], _ = build_variant(drv, tmp, bn, producers, True)
            results.setdefault("builds", {})["fused" + suffix] = usage
            log(f"build fused{suffix} (BN={bn}, {producers} producer warpgroups): {usage}")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    for shape in args.shapes.split(","):
        out_f, in_f = SHAPES[shape]
        ws = weight_set(out_f, in_f, 4 * l2 / 2, seed=len(shape), bits=2)  # row windows: 2x the trellis
        w_ref = escha.dequantize(ws[0]).double()
        dense_rot = dense_weights(out_f, in_f, l2)
        fp8_rot = fp8_weights(dense_rot, l2)
        windows = Windows(drv, ws)
        fused = {suffix: Fused(drv, b, windows) for suffix, b in builds.items()}
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": shape, "N": out_f, "K": in_f, "M": m, "bits": 2}
            try:
                x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
                xq, xscale = actquant(x, ws[0], fp8=True)
                want = dequantize_core(ws[0], torch.float8_e4m3fn)[0].view(torch.uint8)
                ref = x.double() @ w_ref.T
                err_core = rel_err(dequant_core_fp8(x, ws[0]), ref)  # the plain-core path's, for scale
                ok, point["gates"] = True, {}
                for suffix in builds:
                    # Gate 1: the decoded tiles, bit for bit (the DUMP_CORE build; poisoned output).
                    core = torch.full(ws[0].padded_shape, 0xFF, dtype=torch.uint8, device="cuda")
                    Fused(drv, dumps[suffix], windows, core).gemm(0, xq, xscale)
                    torch.cuda.synchronize()
                    differ = int((core != want).sum())
                    # Gate 2: the whole call against fp64.
                    err = rel_err(fused[suffix](0, x), ref)
                    point["gates"]["fused" + suffix] = {"core_values_differ": differ, "rel_err": err,
                                                        "rel_err_dequant_core_fp8": err_core}
                    ok &= differ == 0 and err <= FP8_TOL
                    log(f"gate {shape} M={m} fused{suffix}: decoded tiles "
                        f"{'bit-exact' if differ == 0 else f'DIFFER ({differ})'}; rel err {err:.3e} "
                        f"(dequant_core_fp8 {err_core:.3e})")
                if ok and not args.gate_only:
                    xs = [x, torch.randn_like(x)]
                    arms = {**cublas_arms(xs, dense_rot, fp8_rot),
                            "escha": (lambda i, xs=xs, ws=ws: escha.matmul(xs[i % 2], ws[i]), len(ws)),
                            "core_fp8": (lambda i, xs=xs, ws=ws: dequant_core_fp8(xs[i % 2], ws[i]), len(ws))}
                    if m <= 512:
                        arms["decode_fp8"] = (lambda i, xs=xs, ws=ws: decode_fp8(xs[i % 2], ws[i]), len(ws))
                    zbuf = torch.empty((m, ws[0].padded_shape[0]), dtype=torch.bfloat16, device="cuda")
                    sms = torch.cuda.get_device_properties(0).multi_processor_count
                    for suffix, f in fused.items():
                        arms["fused" + suffix] = (lambda i, f=f, xs=xs: f(i, xs[i % 2]), len(ws))
                        gemm = functools.partial(f.gemm, xq=xq, xscale=xscale, z=zbuf)
                        arms["fused_gemm" + suffix] = (gemm, len(ws))
                        if m <= f.build.bn:  # one wave of programs alone (a part of the product): a round's time
                            arms["fused_gemm_wave" + suffix] = (functools.partial(gemm, programs=sms), len(ws))
                    med = time_arms(timer, arms, args.rounds)
                    point["us"] = med
                    log(f"{shape} M={m:5d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items())
                        + f"  fused/escha {med['fused'] / med['escha']:.3f} fused/bf16 "
                        f"{med['fused'] / med['cublas_bf16']:.3f} fused/fp8 {med['fused'] / med['cublas_fp8']:.3f}")
            except Exception:
                log(f"{shape} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "probe_fused_fp8.json"), "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
