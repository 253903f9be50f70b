"""Host time of one escha.matmul call, eager (no CUDA graph), beside the GPU time of the same call.

    python benchmarks/bench_host.py --out FILE.json [--ms 1,16,512,2048] [--profile FILE.txt] [--parts]

An eager call is bound by whichever is longer: the host work (Python, argument checks, the
dispatch rule, Triton's launches) or the kernels. "host" is the mean wall time of N calls issued
back to back without synchronizing (the host's pace when the GPU keeps up); "eager" adds the final
synchronize; "gpu" is the same call replayed in a CUDA graph (no host work), weights rotated past
L2 (``--host-only`` leaves it out); "host_min" is the least round's host time. Arms: the public
``escha.matmul`` and, where M is in the decode range, ``decode_wgmma`` called directly (what the
custom op and the dispatch cost on top). ``--profile`` writes cProfile's top functions for
escha.matmul at each M. ``--parts``: where M takes the plain-core path through cuBLAS (below
``core_gemm.MIN_M``), the host time of each of its pieces alone, on the kept plan's own launches
(``host_parts``): what an eager prompt's calls spend their host time on, without cProfile's
inflation.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

import escha
from escha.ops import DEFAULT_RULE, resolve_path
from escha.bench.cuda_timing import GraphTimer
from escha.kernels.core_gemm import core_gemm_config
from escha.kernels.decode_wgmma import decode_wgmma, packed_words

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import env_info, weight_set  # noqa: E402

SHAPE = (17408, 5120)  # Qwen3-14B gate/up


def host_us(fn, calls: int, rounds: int) -> tuple[float, float, float]:
    """(median host µs a call, median µs a call with the closing synchronize, least host µs a call)
    over rounds of calls. The least is the steadier figure on a shared host, whose interference
    only ever adds time."""
    host, eager = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) / calls * 1e6)
        eager.append((t2 - t0) / calls * 1e6)
    return statistics.median(host), statistics.median(eager), min(host)


def host_parts(x: torch.Tensor, qw, calls: int, rounds: int) -> dict[str, float]:
    """Median host µs a call of the plain-core path's pieces at x's rows, each launched alone
    ``calls`` times back to back: the op with its checks, the scratch fill, the activation pass,
    cuBLAS's fp8 GEMM, the output pass over z, and one output allocation. The plan is the one
    escha.matmul's first call kept (``dequant_once._plan_key``)."""
    from escha.kernels.actquant import run_actquant
    from escha.kernels.common import CORE_FP8_SCALE, FP8_DTYPE, constant_vector, weight_plans, workspace
    from escha.kernels.dequant import dequant_config
    from escha.kernels.dequant_once import _plan_key, dequant_core_fp8, scaled_mm_rowwise
    cfg = (dequant_config(qw, x.device), core_gemm_config(qw, x.shape[0], x.device))  # the path's own rules
    m = x.shape[0]
    np_, kp = qw.padded_shape
    escha.matmul(x, qw)
    p_t, p_act, p_out = weight_plans(qw)[_plan_key("core", x, qw, True, cfg, None)]
    t = workspace(qw.device, FP8_DTYPE, (np_, kp))
    t_scale = constant_vector(x.device, np_, 1.0 / CORE_FP8_SCALE.value)
    xq, xscale = run_actquant(x, qw, True, p_act)
    z = scaled_mm_rowwise(xq, t.t(), xscale, t_scale)
    y = torch.empty((m, qw.out_features), dtype=x.dtype, device=x.device)
    pieces = {"escha.matmul": lambda: escha.matmul(x, qw),
              "dequant_core_fp8": lambda: dequant_core_fp8(x, qw),
              "fill (Prepared.run)": lambda: p_t.run(t),
              "activation pass (run_actquant)": lambda: run_actquant(x, qw, True, p_act),
              "fp8 GEMM (torch._scaled_mm)": lambda: scaled_mm_rowwise(xq, t.t(), xscale, t_scale),
              "output pass (Prepared.run)": lambda: p_out.run(z, y),
              "torch.empty of y": lambda: torch.empty((m, qw.out_features), dtype=x.dtype, device=x.device)}
    return {name: host_us(fn, calls, rounds)[0] for name, fn in pieces.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,512,2048")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", help="write cProfile's top functions of escha.matmul here")
    ap.add_argument("--host-only", action="store_true", help="leave out the GPU time (a CUDA graph of each arm)")
    ap.add_argument("--parts", action="store_true",
                    help="the host time of each piece of the plain-core path, at the M that take it through cuBLAS")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    ws = weight_set(*SHAPE, 4 * l2 / 2, seed=1)
    for w in ws:
        packed_words(w)
    results = {"env": env_info(), "shape": list(SHAPE), "calls": args.calls, "rounds": args.rounds, "points": []}
    timer = GraphTimer(replays=10)
    profile_text = []
    for m in [int(v) for v in args.ms.split(",")]:
        x = torch.randn(m, SHAPE[1], device="cuda", dtype=torch.bfloat16)
        arms = {"matmul": lambda i: escha.matmul(x, ws[i % len(ws)])}
        if m <= DEFAULT_RULE.decode_max_m:
            arms["decode_wgmma"] = lambda i: decode_wgmma(x, ws[i % len(ws)])
        point = {"M": m, "path": str(resolve_path(m, ws[0])), "us": {}}
        for name, fn in arms.items():
            fn(0)
            host, eager, least = host_us(lambda fn=fn: fn(0), args.calls, args.rounds)
            gpu = None if args.host_only else statistics.median(timer.build(fn, len(ws), name).sample() for _ in range(3))
            point["us"][name] = {"host": host, "eager": eager, "host_min": least, "gpu": gpu}
            print(f"M={m:5d} {name:13s} host {host:7.1f} us (least {least:7.1f})  eager {eager:7.1f} us  gpu "
                  f"{'-' if gpu is None else f'{gpu:7.1f}'} us", flush=True)
        if args.parts and point["path"] == "dequant-core-fp8" and core_gemm_config(ws[0], m) is None:
            point["parts_host_us"] = host_parts(x, ws[0], args.calls, args.rounds)
            for name, us in point["parts_host_us"].items():
                print(f"M={m:5d}   part {name:32s} host {us:7.1f} us", flush=True)
        results["points"].append(point)
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(50):
                arms["matmul"](0)
            pr.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            profile_text.append(f"# escha.matmul, M={m}, 50 calls\n{s.getvalue()}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.profile:
        with open(args.profile, "w") as f:
            f.write("\n".join(profile_text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
