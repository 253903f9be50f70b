"""The rule's capped K=3 builds (32 and 64 tokens, REGISTER_CAPS) under compute-sanitizer: every
launch of a few calls at 17-64 tokens on two shapes, the rule's grid and one step a program,
each output within the tolerance table against the fp64 product. On the H200, repository root:

    compute-sanitizer --tool memcheck --error-exitcode 99 python benchmarks/results/k3_cap/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 99 python benchmarks/results/k3_cap/sanitize.py

(Not run yet: the cap landed on the GPU tests and the timings of h200_d2fb6ec/.)"""
import dataclasses
import importlib
import os
import sys

import torch

from escha.format import dequantize, random_qweight

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_decode_wgmma import TOL  # noqa: E402  (the tolerance table the benchmark gates with)

dw = importlib.import_module("escha.kernels.decode_wgmma")
over = 0
for shape in ((300, 700), (640, 1536)):
    qw = random_qweight(*shape, bits=3, seed=sum(shape), device="cuda")
    ref_w = dequantize(qw).double()
    for m in (17, 32, 33, 64):
        x = torch.randn(m, shape[1], device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ ref_w.T
        cfg = dw.decode_wgmma_config(qw, m)
        assert cfg.max_registers == 128, cfg
        steps = qw.padded_shape[0] // (64 * cfg.fragments) * (qw.padded_shape[1] // 128)
        for c in (cfg, dataclasses.replace(cfg, programs=steps)):
            y = dw.decode_wgmma(x, qw, config=c)
            torch.cuda.synchronize()
            err = float((y.double() - ref).norm() / ref.norm())
            over += not err <= TOL[torch.bfloat16]
            print(f"{shape} M={m} programs={c.programs}: rel err {err:.2e}",
                  "ok" if err <= TOL[torch.bfloat16] else "OVER")
if over:
    raise SystemExit(f"{over} calls over the tolerance table")
