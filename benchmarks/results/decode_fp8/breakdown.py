"""Where decode_fp8's time goes on the H200: its three kernels each timed alone (the input transform's
fp8 form, the GEMM, the output transform; plain launches) beside the fp16 register-operand kernel's GEMM and
its whole call, gate_up and down at 64, 128, 256 and 512 tokens (weights rotated past L2, CUDA graphs,
median of 3 rounds, bench_decode_wgmma's harness).
Usage (repository root, on the GPU): python benchmarks/results/decode_fp8/breakdown.py OUT_DIR"""
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_decode import env_info, weight_set  # noqa: E402
from bench_decode_wgmma import SHAPES, time_arms  # noqa: E402
from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.kernels.transforms import hadamard_input, hadamard_output, prepare_input  # noqa: E402

df = importlib.import_module("escha.kernels.decode_fp8")
dw = importlib.import_module("escha.kernels.decode_wgmma")
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
res = {"env": env_info(), "points": []}
l2 = torch.cuda.get_device_properties(0).L2_cache_size
timer = GraphTimer(replays=10)
for name in ("gate_up", "down"):
    n, k = SHAPES[name]
    ws = weight_set(n, k, 4 * l2 / 2, seed=len(name), bits=2)
    for w in ws:
        dw.packed_words(w)
    for m in (64, 128, 256, 512):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = df.decode_fp8_config(ws[0], m, x.device)
        plain = cfg.__class__(**{**cfg.__dict__, "dependent_launch": False})
        xq, inv, _ = prepare_input(x, ws[0], keep=False, fp8=True)
        z, counts = df.gemm_partials(xq, ws[0], plain)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        c16 = dw.decode_wgmma_config(ws[0], m, x.device)
        plain16 = c16.__class__(**{**c16.__dict__, "dependent_launch": False, "early_start": False})
        xq16, _ = hadamard_input(x, ws[0], mma_order=True, halves=plain16.halves)
        arms = {
            "fp8_call": lambda i: df.decode_fp8(x, ws[i], config=cfg),
            "fp8_input": lambda i: prepare_input(x, ws[i], keep=False, fp8=True),
            "fp8_gemm": lambda i: df.gemm_partials(xq, ws[i], plain),
            "fp8_output": lambda i: hadamard_output(z, ws[i], inv, y, segments=counts),
            "fp16_call": lambda i: dw.decode_wgmma(x, ws[i]),
            "fp16_gemm": lambda i: dw.gemm_partials(xq16, ws[i], plain16),
        }
        med = time_arms(timer, {a: (fn, len(ws)) for a, fn in arms.items()}, 3)
        line = f"{name} M={m} segments={z.shape[0]} " + " ".join(f"{a} {v:.1f}" for a, v in med.items())
        print(line, flush=True)
        res["points"].append({"shape": name, "M": m, "config": cfg.__dict__, "us": med, "segments": z.shape[0]})
with open(os.path.join(out, "breakdown.json"), "w") as f:
    json.dump(res, f, indent=1)
