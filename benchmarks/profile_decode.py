"""One decode GEMM call per path, for a profiler to wrap (ncu, compute-sanitizer).

    ncu --clock-control none -k regex:decode --launch-skip 3 --launch-count 1 --set full \\
        python benchmarks/profile_decode.py --path wgmma --shape gate_up --m 8

Runs the chosen path ``--calls`` times on one random weight (the first calls compile).
"""
from __future__ import annotations

import argparse

import torch

from escha.format import random_qweight
from escha.kernels import decode
from escha.kernels.decode_wgmma import decode_wgmma

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", choices=("wgmma", "portable"), default="wgmma")
    ap.add_argument("--shape", choices=tuple(SHAPES), default="gate_up")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    qw = random_qweight(*SHAPES[args.shape], bits=2, seed=0, device="cuda")
    x = torch.randn(args.m, qw.in_features, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.calls):
        if args.path == "wgmma":
            decode_wgmma(x, qw)
        else:
            decode(x, qw)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
