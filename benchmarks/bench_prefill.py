"""Prefill benchmark on one GPU: escha's prefill paths against fp8 and bf16 cuBLAS, same process.

Method: the timing of ``escha bench`` (escha.bench: ``method.rotation_buffers``,
``cuda_timing.GraphTimer``, ``method.round_order``, ``method.Spread``), so that the two agree. Each
arm is captured as a CUDA graph of calls that rotate over enough weight buffers to make the working
set >= 4x L2 (escha's 2-bit weights need ~12-23 buffers, the fp8/bf16 baselines 2-3); graphs are
replayed in interleaved rounds (>= 5, the arm order rotated each round), each sample one untimed
replay then three timed ones between CUDA events; a row is the median per-call time. Activations
are fresh random bf16 (never zeros), as in ``escha bench``; the fp8 baselines get pre-quantized
activations (their quantization is not timed), escha's arms include their own activation
transform and quantization. This script adds what ``escha bench`` does not time: the parts of
the dequantize-once path and launch-shape variants of each op.

Usage: python benchmarks/bench_prefill.py [--out DIR] [--ms 512,2048,8192] [--rounds 5]
Writes prefill.json (every sample) and prefill.md (tables) under --out; prints the table.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.bench.method import Spread, rotation_buffers, round_order  # noqa: E402
from escha.format import dequantize, random_qweight  # noqa: E402
from escha.format.qweight import QuantizedWeight  # noqa: E402
from escha.kernels import (ActQuantConfig, actquant, actquant_config, dequant_bf16, dequant_fp8,  # noqa: E402
                           dequant_once_config, prefill, prefill_config)
from escha.kernels.common import FP8_DTYPE, workspace  # noqa: E402
from escha.kernels.dequant import _dequant_kernel, dequant_config, dequantize_core  # noqa: E402
from escha.kernels.dequant_once import dequant_core_bf16, dequant_core_fp8, dequant_hn, dequant_hn_kernel  # noqa: E402
from escha.kernels.transforms import _input_transform_kernel, _output_hadamard_kernel, hadamard_output_dense  # noqa: E402
from escha.kernels.prefill import prefill_kernel  # noqa: E402

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704)}
L2_FACTOR = 4
# Launch-shape overrides of each op's rule (dataclasses.replace on the rule's config at each point).
PREFILL_CONFIGS = {
    "prefill-bm128w8": dict(block_m=128, num_warps=8, num_stages=1),
    "prefill-bm256w8": dict(block_m=256, num_warps=8, num_stages=1),
}
# Alternatives of the two dequantize-once stages, timed as extra "part-" arms so one run shows
# whether the rules' choices are the best of these candidates. The activation pass's variants
# map the rule's config and the row's Hadamard blocks to another: one tile a program ("t1"), half
# a row a program ("half"), and whole rows in tiles of 4 to 32 blocks.
ACTQUANT_VARIANTS = {
    "t1": lambda c, nkb: replace(c, tiles=1),
    "half": lambda c, nkb: replace(c, tiles=-(-nkb // (2 * c.blocks))),
    "b4-row": lambda c, nkb: ActQuantConfig(4, -(-nkb // 4)),
    "b8-row": lambda c, nkb: ActQuantConfig(8, -(-nkb // 8)),
    "b16-row": lambda c, nkb: ActQuantConfig(16, -(-nkb // 16)),
    "b32-row": lambda c, nkb: ActQuantConfig(32, -(-nkb // 32)),
}
DEQUANT_VARIANTS = {  # the rule's choice is BK=64, 4 warps, 3 stages
    "bk64w4s3": dict(),
    "bk64w4s2": dict(num_stages=2),
    "bk64w8s3": dict(num_warps=8, num_stages=3),
    "bk64w8s2-k16": dict(num_warps=8, num_stages=2, k_per_prog=16),
    "bk128w8s2": dict(k_per_prog=4, block_k=128, num_warps=8, num_stages=2),
}

DEQUANT_CORE_VARIANTS = {  # dequant_config's rule: 128 x 128 a program, 4 warps
    "bn128w8": dict(num_warps=8),
    "bn64w4": dict(block_n=64),
}


def actquant_variant(qw: QuantizedWeight, m: int, name: str) -> ActQuantConfig:
    """The activation config of variant ``name`` (``ACTQUANT_VARIANTS``) at m rows."""
    return ACTQUANT_VARIANTS[name](actquant_config(qw, m), qw.padded_shape[1] // 128)


@dataclass
class Row:
    shape: str
    m: int
    arm: str
    us: float
    low: float
    high: float
    samples: list = field(default_factory=list)


MIN_CALLS = 6  # calls per graph for arms on one buffer (a lone short call is mostly launch)
_seeds = itertools.count(1)


def random_weights(n: int, k: int, count: int, dev: str) -> list[QuantizedWeight]:
    """``count`` independent random weights (distinct seeds, as escha bench makes them)."""
    return [random_qweight(n, k, 2, seed=next(_seeds), device=dev) for _ in range(count)]


KERNELS = {
    "prefill": prefill_kernel,
    "input_transform": _input_transform_kernel,
    "dequant_hn": dequant_hn_kernel,
    "dequant_core": _dequant_kernel,
    "output_hadamard": _output_hadamard_kernel,
}


def kernel_report() -> dict:
    """Registers, spills, shared memory and the tensor-core instructions of every compiled kernel."""
    rep = {}
    for kname, kern in KERNELS.items():
        caches = getattr(kern, "device_caches", {})
        for dev_cache in caches.values():
            for key, ck in dev_cache[0].items():
                rep[kname + ":" + str(key)[:160]] = _kernel_info(ck)
    return rep


def _kernel_info(ck) -> dict:
    """One compiled kernel: registers, spills, shared memory, wgmma in PTX, QGMMA/HGMMA in SASS."""
    info = {"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None),
            "shared": getattr(getattr(ck, "metadata", None), "shared", None)}
    try:
        ptx = ck.asm["ptx"]
        info["ptx_wgmma_e4m3"] = ptx.count("wgmma.mma_async") and ("e4m3" in ptx)
        info["ptx_wgmma_count"] = ptx.count("wgmma.mma_async")
    except Exception as e:  # noqa: BLE001
        info["ptx"] = repr(e)
    try:
        sass = ck.asm["sass"]
        info["sass_QGMMA"] = sass.count("QGMMA")
        info["sass_HGMMA"] = sass.count("HGMMA")
        info["sass_LDL_STL"] = sass.count("LDL") + sass.count("STL")
    except Exception as e:  # noqa: BLE001
        info["sass"] = repr(e)[:200]
    return info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--ms", default="512,2048,8192")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=",".join(PREFILL_CONFIGS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    l2 = props.L2_cache_size
    print(f"{props.name} SMs={props.multi_processor_count} L2={l2 >> 20}MB torch={torch.__version__}",
          flush=True)
    rows: list[Row] = []
    accuracy: dict = {}
    configs = [c for c in args.configs.split(",") if c]
    t_start = time.time()
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        nq = rotation_buffers(l2, QuantizedWeight.placeholder((n, k), 2, device="meta").bits_per_weight * n * k / 8)
        qws = random_weights(n, k, nq, dev)
        n8 = rotation_buffers(l2, n * k)
        w8 = [torch.randn(n, k, device=dev).div_(8).to(torch.float8_e4m3fn) for _ in range(n8)]
        sb = torch.rand(1, n, device=dev) + 0.5
        n16 = rotation_buffers(l2, 2 * n * k)
        w16 = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(n16)]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq8 = (x.float() / (x.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
            sa = torch.rand(m, 1, device=dev) + 0.5
            arms = {
                "cublas-fp8-rowwise": (lambda i: torch._scaled_mm(xq8, w8[i % n8].t(), scale_a=sa, scale_b=sb,
                                                                  out_dtype=torch.bfloat16), n8),
                "cublas-bf16": (lambda i: x @ w16[i % n16].t(), n16),
                "escha-dequant-fp8": (lambda i: dequant_fp8(x, qws[i % nq]), nq),
                "escha-dequant-bf16": (lambda i: dequant_bf16(x, qws[i % nq]), nq),
                "part-actquant": (lambda i: actquant(x, qws[0], fp8=True), 1),
                "part-dequant-fp8": (lambda i: dequant_hn(qws[i % nq], fp8=True), nq),
            }
            seen = {actquant_config(qws[0], m)}
            for vname in ACTQUANT_VARIANTS:
                acfg = actquant_variant(qws[0], m, vname)
                if acfg in seen:  # the rule's own config, or a variant that equals another here
                    continue
                seen.add(acfg)
                arms["part-actquant-" + vname] = (
                    (lambda c: lambda i: actquant(x, qws[0], fp8=True, config=c))(acfg), 1)
            for vname, over in list(DEQUANT_VARIANTS.items())[1:]:
                dcfg = replace(dequant_once_config(qws[0], m), **over)
                arms["part-dequant-fp8-" + vname] = (
                    (lambda c: lambda i: dequant_hn(qws[i % nq], fp8=True, config=c))(dcfg), nq)
            # The plain-core path: e4m3(64 T) without the Hadamard product, the fp8 GEMM, then Hn
            # and the row scales in a pass over z (its two new parts alone, and the whole path).
            np_, kp = qws[0].padded_shape
            zbuf = torch.randn(m, np_, device=dev, dtype=torch.bfloat16)
            ybuf = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            arms["part-dequant-core-fp8"] = (lambda i: dequantize_core(
                qws[i % nq], FP8_DTYPE, out=workspace(qws[0].device, FP8_DTYPE, (np_, kp))), nq)
            for vname, over in DEQUANT_CORE_VARIANTS.items():
                ccfg = replace(dequant_config(qws[0]), **over)
                arms["part-dequant-core-fp8-" + vname] = ((lambda c: lambda i: dequantize_core(
                    qws[i % nq], FP8_DTYPE, config=c, out=workspace(qws[0].device, FP8_DTYPE, (np_, kp))))(ccfg), nq)
            arms["part-output-hadamard"] = (lambda i: hadamard_output_dense(zbuf, qws[0], ybuf), 1)
            arms["escha-dequant-core-fp8"] = (lambda i: dequant_core_fp8(x, qws[i % nq]), nq)
            # The same at the bf16 precision, beside escha-dequant-bf16 (the folded bf16 scratch).
            arms["part-dequant-core-bf16"] = (lambda i: dequantize_core(
                qws[i % nq], torch.bfloat16, out=workspace(qws[0].device, torch.bfloat16, (np_, kp))), nq)
            arms["part-dequant-bf16"] = (lambda i: dequant_hn(qws[i % nq], fp8=False), nq)
            arms["escha-dequant-core-bf16"] = (lambda i: dequant_core_bf16(x, qws[i % nq]), nq)
            for name in configs:
                pcfg = replace(prefill_config(qws[0], m), **PREFILL_CONFIGS[name])
                arms["escha-" + name] = ((lambda c: lambda i: prefill(x, qws[i % nq], config=c))(pcfg), nq)
            # Correctness at this size before timing: every escha arm against fp32 x @ W_hat^T.
            if m == min(int(v) for v in args.ms.split(",")):
                ref = x.float() @ dequantize(qws[0]).T
                for name, (fn, _) in arms.items():
                    if name.startswith("escha-"):
                        y = fn(0)
                        err = float((y.float() - ref).norm() / ref.norm())
                        accuracy[f"{shape}/M={m}/{name}"] = err
                        print(f"  accuracy {shape} M={m} {name}: rel err {err:.3e}", flush=True)
                        if not math.isfinite(err) or err > 0.08:
                            print(f"  FAILED accuracy gate for {name}", flush=True)
                del ref
            samplers = {}
            for name, (fn, nb) in arms.items():
                try:
                    samplers[name] = GraphTimer().build(fn, max(nb, MIN_CALLS), name)
                except Exception as e:  # noqa: BLE001
                    print(f"  {name}: capture failed: {e!r}"[:300], flush=True)
            samples = {name: [] for name in samplers}
            names = list(samplers)
            for r in range(args.rounds):
                for i in round_order(len(names), r):
                    samples[names[i]].append(samplers[names[i]].sample())
            for name in names:
                spread = Spread.of(samples[name])
                rows.append(Row(shape, m, name, spread.median, spread.low, spread.high, samples[name]))
            del samplers
            torch.cuda.empty_cache()
            base = {r.arm: r.us for r in rows if r.shape == shape and r.m == m}
            for name in names:
                flops = 2 * m * n * k
                print(f"{shape:8s} M={m:5d} {name:24s} {base[name]:9.1f} us "
                      f"{flops / base[name] / 1e6:7.1f} TF/s  x{base[name] / base['cublas-fp8-rowwise']:.3f} "
                      f"of fp8 rowwise", flush=True)
            print(f"  [{time.time() - t_start:.0f}s]", flush=True)
        qws = w8 = w16 = None  # the shape's buffers freed before the next shape's
        torch.cuda.empty_cache()
    kr = kernel_report()
    with open(os.path.join(args.out, "prefill.json"), "w") as f:
        json.dump({"device": props.name, "torch": torch.__version__, "rows": [asdict(r) for r in rows],
                   "accuracy": accuracy, "kernels": kr}, f, indent=1)
    for key, info in kr.items():
        print("kernel", key.split(":")[0], info, flush=True)


if __name__ == "__main__":
    main()
