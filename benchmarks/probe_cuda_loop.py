"""Does the register-operand decode loop gain from being written in CUDA C++?

``probe_cuda_loop.cu`` is decode_wgmma's GEMM kernel at the rule's 8-token build (K = 2, the
halves codec, one 64-row fragment, a ring of 3) with a producer warp issuing the TMA copies, no
CTA barrier in the consumer's loop, and the loop unrolled over the ring so the MMA descriptors
are constants: 313 instructions a k-block against the Gluon build's 372 (offline census,
docs/KERNELS.md "The next structural step"). This probe builds it with nvcc for sm_90a at two
register budgets (MINB programs an SM of 160 threads: 4 -> 96 registers; 5 -> 72, with spills),
launches it through the CUDA driver API (ctypes; the tensor maps by cuTensorMapEncodeTiled) on
the operands decode_wgmma gives its GEMM (x' from ``hadamard_input(..., halves=True)``, the
weight's ``packed_words``), and:

- gates it: its fp32 partials against the Gluon kernel's at the same grid, bit for bit (same
  MMAs in the same order), on NaN-poisoned output; and the whole product (the partials through
  ``hadamard_output``) against fp64 within the decode tolerance table;
- times the GEMM alone, both kernels on the same x' and the same rotated weights (>= 4x L2), one
  CUDA graph an arm, interleaved rounds, median: ``gluon`` (the rule's grid, 5 programs an SM),
  ``gluon_w4`` (4 an SM), ``cuda_w4`` / ``cuda_w5`` (the 96-register build at 4 or 5 programs
  an SM's grid; it holds 4), ``cuda_c72_w5`` (the 72-register build at 5), beside cuBLAS bf16's
  whole product.

Nothing in the library changes. ``nvcc`` must be on PATH (the H200 image has 13.0).

    python benchmarks/probe_cuda_loop.py --out DIR [--ms 1,8] [--shapes gate_up,down,qkv_8b,down_8b] [--gate-only]
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import traceback

import torch

from escha.bench.cuda_timing import GraphTimer
from escha.kernels.decode_wgmma import (
    decode_wgmma_config,
    gemm_partials,
    packed_words,
    segment_counts,
)
from escha.kernels.transforms import hadamard_input, hadamard_output

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode_wgmma import (
    SHAPES,
    TOL,
    cublas_arms,
    packed_weights,
    rel_err,
    start_run,
    time_arms,
)

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "probe_cuda_loop.cu")
THREADS = 160  # four consumer warps and the producer warp
STAGES, BN = 3, 8
STAGE_BYTES = 4 * BN * 64 * 2 + 1024 * 4
SMEM_BYTES = STAGES * STAGE_BYTES + 2 * STAGES * 8
BUILDS = {"w96": 4, "c72": 5}  # build -> MINB (__launch_bounds__ min blocks): 96 and 72 registers

# CUDA driver enums (cuda.h, CUDA 13.0)
_U8, _U16, _I32 = 0, 1, 3  # CUtensorMapDataType: UINT8, UINT16 (x' as raw fp16 bits), INT32
_SWIZZLE_NONE, _SWIZZLE_128B = 0, 3
_L2_128B = 2
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def nvcc_cubin(source: str, defines: tuple[str, ...], path: str) -> tuple[bytes, str]:
    """(cubin, ptxas's resource lines) of ``source`` built by nvcc for sm_90a into ``path``."""
    r = subprocess.run(["nvcc", "-cubin", "-O3", "-gencode=arch=compute_90a,code=sm_90a", *defines,
                        "-Xptxas", "-v", "-o", path, source], capture_output=True, text=True, check=True)
    with open(path, "rb") as f:
        return f.read(), " ".join(line.strip() for line in r.stderr.splitlines() if "Used" in line or "spill" in line)


def build(minb: int, tmp: str) -> tuple[bytes, str]:
    """(cubin, ptxas's resource line) of probe_cuda_loop.cu for sm_90a at MINB = minb."""
    return nvcc_cubin(SOURCE, (f"-DMINB={minb}",), os.path.join(tmp, f"decode_loop_{minb}.cubin"))


class Driver:
    """The few CUDA driver calls the probe needs, through ctypes on libcuda (torch has made the
    device's primary context current)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise RuntimeError(f"{what}: CUDA driver error {rc} ({name.value.decode() if name.value else '?'})")

    def function(self, cubin: bytes, name: str, smem: int) -> ctypes.c_void_p:
        """Kernel ``name`` of ``cubin``, allowed ``smem`` bytes of dynamic shared memory."""
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._image = getattr(self, "_image", []) + [ctypes.create_string_buffer(cubin, len(cubin))]
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), self._image[-1]), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), "cuModuleGetFunction")
        self.check(self.lib.cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED, smem), "cuFuncSetAttribute")
        return fn

    def tensor_map(self, t: torch.Tensor, dtype: int, box: tuple[int, int], swizzle: int) -> ctypes.Array:
        """A 2-D CUtensorMap (128 bytes, 64-byte aligned) over the contiguous [rows, cols] tensor t,
        box (box_cols, box_rows)."""
        raw = (ctypes.c_uint8 * 192)()
        addr = (ctypes.addressof(raw) + 63) & ~63
        rows, cols = t.shape
        dims = (ctypes.c_uint64 * 2)(cols, rows)
        strides = (ctypes.c_uint64 * 1)(cols * t.element_size())
        boxd = (ctypes.c_uint32 * 2)(*box)
        elem = (ctypes.c_uint32 * 2)(1, 1)
        self.check(self.lib.cuTensorMapEncodeTiled(ctypes.c_void_p(addr), dtype, 2, ctypes.c_void_p(t.data_ptr()),
                                                   dims, strides, boxd, elem, 0, swizzle, _L2_128B, 0),
                   "cuTensorMapEncodeTiled")
        view = (ctypes.c_uint8 * 128).from_address(addr)
        view._keep = raw  # the aligned view keeps its buffer alive
        return view

    def launch(self, fn, grid: tuple[int, int], threads: int, smem: int, args: list) -> None:
        """Launch ``fn`` on torch's current stream (captured into a CUDA graph when one is being
        captured); ``args`` are ctypes objects, one per kernel parameter."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.check(self.lib.cuLaunchKernel(fn, grid[0], grid[1], 1, threads, 1, 1, smem, stream, params, None),
                   "cuLaunchKernel")


class CudaLoop:
    """The CUDA kernel's launch on x' for a set of weights at a fixed grid: ``__call__(i)`` runs it
    on weight i into the preallocated partials ``ws``."""

    def __init__(self, drv: Driver, fn, xq: torch.Tensor, weights: list, programs: int) -> None:
        np_, kp = weights[0].padded_shape
        m = xq.shape[0]
        self.drv, self.fn = drv, fn
        tiles, nkb = np_ // 64, kp // 128
        self.steps = tiles * nkb
        self.programs = min(programs, self.steps)
        self.counts = segment_counts(self.programs, tiles, nkb, 1, xq.device)
        segs = int(self.counts.max())
        self.ws = torch.full((segs, m, np_), float("nan"), device=xq.device)
        self.x_map = drv.tensor_map(xq.view(torch.int16), _U16, (64, BN), _SWIZZLE_128B)
        self.w_maps = [drv.tensor_map(packed_words(w).view(-1, 128), _I32, (128, 8), _SWIZZLE_NONE) for w in weights]
        self.scalars = [ctypes.c_uint64(self.ws.data_ptr())] + [ctypes.c_int32(v) for v in
                                                                (m, np_, nkb, self.steps, self.programs)]
        self.grid = (self.programs, -(-m // BN))

    def __call__(self, i: int) -> torch.Tensor:
        self.drv.launch(self.fn, self.grid, THREADS, SMEM_BYTES + 1024, [self.x_map, self.w_maps[i]] + self.scalars)
        return self.ws


def written_equal(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> tuple[bool, int]:
    """Whether the partials each 64-row group has written (``counts`` segments) are equal bit for
    bit in a and b, and how many values differ."""
    diff = 0
    for g, c in enumerate(counts.tolist()):
        x, y = a[:c, :, 64 * g:64 * g + 64], b[:c, :, 64 * g:64 * g + 64]
        diff += int((x.view(torch.int32) != y.view(torch.int32)).sum())
    return diff == 0, diff


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--shapes", default="gate_up,down,qkv_8b,down_8b")
    ap.add_argument("--gate-only", action="store_true", help="gates, no timing (for compute-sanitizer)")
    args = ap.parse_args()
    log, results = start_run(args.out, "probe_cuda_loop.log")
    torch.zeros(1, device="cuda")  # the primary context, current for the driver calls
    drv = Driver()
    fns = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, minb in BUILDS.items():
            cubin, usage = build(minb, tmp)
            fns[name] = drv.function(cubin, "decode_loop_kernel", SMEM_BYTES + 1024)
            results.setdefault("builds", {})[name] = {"minb": minb, "ptxas": usage}
            log(f"build {name}: MINB={minb}: {usage}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    for shape in args.shapes.split(","):
        out_f, in_f = SHAPES[shape]
        ws, w_ref, dense_rot = packed_weights(shape, 2, l2, {})
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": shape, "N": out_f, "K": in_f, "M": m, "bits": 2, "gates": {}}
            try:
                cfg = decode_wgmma_config(ws[0], m)
                if (cfg.block_tokens, cfg.fragments, cfg.stages, cfg.halves) != (BN, 1, STAGES, True):
                    raise ValueError(f"the rule's build at M={m} is not the one the CUDA kernel mirrors: {cfg}")
                plain = dataclasses.replace(cfg, dependent_launch=False, early_start=False)
                x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
                xq, inv = hadamard_input(x, ws[0], mma_order=True, halves=True)
                arms = {**cublas_arms([x, x], dense_rot)}
                ref = x.double() @ w_ref.T
                gluon = {}  # the Gluon kernel's partials (and counts) at each grid gated against
                ok_all = True
                for arm, build_name, per_sm in (("cuda_w4", "w96", 4), ("cuda_w5", "w96", 5),
                                                ("cuda_c72_w5", "c72", 5)):
                    loop = CudaLoop(drv, fns[build_name], xq, ws, per_sm * sms)
                    z = loop(0)
                    if loop.programs not in gluon:
                        grid = dataclasses.replace(plain, programs=loop.programs)
                        gluon[loop.programs] = gemm_partials(xq, ws[0], grid)
                    zg, counts = gluon[loop.programs]
                    torch.cuda.synchronize()
                    same, diff = written_equal(z, zg, counts)
                    y = torch.empty(m, out_f, device="cuda", dtype=torch.bfloat16)
                    hadamard_output(z, ws[0], inv, y, segments=loop.counts)
                    err = rel_err(y, ref)
                    point["gates"][arm] = {"bit_exact_vs_gluon": same, "values_differ": diff, "rel_err_bf16": err}
                    log(f"gate {shape} M={m} {arm}: partials {'bit-exact' if same else f'DIFFER ({diff})'} "
                        f"against Gluon at {loop.programs} programs; product rel err {err:.3e}")
                    if same and err <= TOL[torch.bfloat16]:
                        arms[arm] = (loop, len(ws))
                    else:
                        ok_all = False
                point.update(gates_ok=ok_all, config=dataclasses.asdict(cfg))
                if not args.gate_only:
                    arms["gluon"] = (lambda i, xq=xq, ws=ws, c=plain: gemm_partials(xq, ws[i], c)[0], len(ws))
                    g4 = dataclasses.replace(plain, programs=min(4 * sms, plain.programs))
                    arms["gluon_w4"] = (lambda i, xq=xq, ws=ws, c=g4: gemm_partials(xq, ws[i], c)[0], len(ws))
                    med = time_arms(timer, arms, args.rounds)
                    point["us"] = med
                    log(f"{shape} M={m:3d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items())
                        + "".join(f"  {k}/gluon {med[k] / med['gluon']:.3f}" for k in med if k.startswith("cuda")))
            except Exception:
                log(f"{shape} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "probe_cuda_loop.json"), "w") as f:
                json.dump(results, f, indent=1)
        del ws, w_ref, dense_rot
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
