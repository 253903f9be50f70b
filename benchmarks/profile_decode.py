"""One decode GEMM call per path, for a profiler to wrap (ncu, compute-sanitizer), or a timeline.

    ncu --clock-control none -k regex:decode --launch-skip 3 --launch-count 1 --set full \\
        python benchmarks/profile_decode.py --path wgmma --shape gate_up --m 8
    python benchmarks/profile_decode.py --shape down --m 1 --start early --timeline early.json

Runs the chosen path ``--calls`` times on one random weight (the first calls compile).
``--start early|late`` overrides the register-operand kernel's GEMM start (its rule otherwise);
``--cap LABEL`` builds it as ``bench_decode_wgmma.py --cap-variants`` does (CAP_ARMS' ``cap_LABEL``).
``--timeline FILE`` captures ``--calls`` calls in one CUDA graph, replays it under the torch
profiler and writes, per call, each kernel's start and end in µs from the call's first kernel
(where the GEMM begins and ends against the input transform shows what an early start
overlaps), with the GPU's name.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from escha.format import random_qweight
from escha.kernels import decode
from escha.kernels.decode_fp8 import decode_fp8
from escha.kernels.decode_wgmma import decode_wgmma, decode_wgmma_config

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704), "qkv_8b": (6144, 4096), "down_8b": (4096, 14336)}


def timeline(run, calls: int) -> list[list[dict]]:
    """Kernels of ``calls`` back-to-back runs captured in one CUDA graph (no host gaps, as in a
    decode step) and replayed under the torch profiler, grouped per run by the number of kernels
    one run launches: [{name, start_us, end_us}] from the run's first kernel."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.autograd.DeviceType.CUDA
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()  # compiled by the earlier calls; counts one run's kernels
        torch.cuda.synchronize()
    per_call = sum(e.device_type == cuda for e in prof.events())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == cuda)
    out = []
    for i in range(0, len(kernels) - per_call + 1, per_call):
        t0 = kernels[i][0]
        out.append([{"name": n, "start_us": s - t0, "end_us": e - t0} for s, e, n in kernels[i:i + per_call]])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("wgmma", "portable", "fp8"), default="wgmma")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="gate_up")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--start", choices=("rule", "early", "late"), default="rule")
    ap.add_argument("--timeline", help="write the calls' kernel timeline (JSON) here")
    ap.add_argument("--cap", help="the register-cap variant LABEL of bench_decode_wgmma.CAP_ARMS (cap_LABEL)")
    args = ap.parse_args()
    qw = random_qweight(*SHAPES[args.shape], bits=2, seed=0, device="cuda")
    x = torch.randn(args.m, qw.in_features, device="cuda", dtype=torch.bfloat16)
    cfg = decode_wgmma_config(qw, args.m, x.device)
    if args.start != "rule":
        cfg = dataclasses.replace(cfg, early_start=args.start == "early")
    if args.cap:
        from bench_decode_wgmma import cap_variants  # beside this script, on sys.path when it runs
        cfg = cap_variants(cfg, qw, args.m)["cap_" + args.cap]

    def run() -> None:
        if args.path == "wgmma":
            decode_wgmma(x, qw, config=cfg)
        elif args.path == "fp8":
            decode_fp8(x, qw)
        else:
            decode(x, qw)

    for _ in range(3):  # compile outside the capture
        run()
    torch.cuda.synchronize()
    if args.timeline:
        calls = timeline(run, args.calls)
        with open(args.timeline, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "shape": args.shape, "M": args.m, "path": args.path,
                       "config": dataclasses.asdict(cfg) if args.path == "wgmma" else None, "calls": calls}, f,
                      indent=1)
        return
    for _ in range(args.calls):
        run()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
