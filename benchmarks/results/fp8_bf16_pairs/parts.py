"""The fp8 decode GEMM and the output transform each timed alone, this tree against the previous
tree's copies (``benchmarks/snapshot_kernels.sh base REV``: .prev/decode_fp8_base.py and its
transforms): where the bf16 pairs move the call. Plain launches (no dependent launch), weights
rotated past L2, CUDA graphs, median of ``rounds`` interleaved rounds (bench_decode_wgmma's harness).
Usage (repository root, on the GPU): python benchmarks/results/fp8_bf16_pairs/parts.py OUT_DIR [ROUNDS]"""
import dataclasses
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_decode import env_info, load_previous, weight_set  # noqa: E402
from bench_decode_wgmma import SHAPES, time_arms  # noqa: E402
from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.kernels.transforms import hadamard_output, prepare_input  # noqa: E402

df = importlib.import_module("escha.kernels.decode_fp8")
dw = importlib.import_module("escha.kernels.decode_wgmma")
prev = load_previous(".prev/decode_fp8_base.py")
prev_t = sys.modules["escha.kernels._transforms_base"]
out = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
os.makedirs(out, exist_ok=True)
res = {"env": env_info(), "points": []}
l2 = torch.cuda.get_device_properties(0).L2_cache_size
timer = GraphTimer(replays=10)
for name in ("gate_up", "down"):
    n, k = SHAPES[name]
    ws = weight_set(n, k, 4 * l2 / 2, seed=len(name), bits=2)
    for w in ws:
        dw.packed_words(w)
    for m in (128, 256):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        cfg = dataclasses.replace(df.decode_fp8_config(ws[0], m, x.device), dependent_launch=False)
        pcfg = prev.DecodeFp8Config(**{**dataclasses.asdict(cfg)})
        xq, inv, _ = prepare_input(x, ws[0], keep=False, fp8=True, mma_order=True)
        z, counts = df.gemm_partials(xq, ws[0], cfg)
        zp, countsp = prev.gemm_partials(xq, ws[0], pcfg)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        yp = torch.empty_like(y)
        hadamard_output(z, ws[0], inv, y, segments=counts)
        prev_t.hadamard_output(zp, ws[0], inv, yp, segments=countsp)
        diff = float(((y.double() - yp.double()).norm() / yp.double().norm()))
        arms = {
            "gemm": lambda i: df.gemm_partials(xq, ws[i], cfg),
            "gemm@base": lambda i: prev.gemm_partials(xq, ws[i], pcfg),
            "output": lambda i: hadamard_output(z, ws[i], inv, y, segments=counts),
            "output@base": lambda i: prev_t.hadamard_output(zp, ws[i], inv, yp, segments=countsp),
        }
        med = time_arms(timer, {a: (fn, len(ws)) for a, fn in arms.items()}, rounds)
        line = (f"{name} M={m} segments={z.shape[0]} " + " ".join(f"{a} {v:.1f}" for a, v in med.items())
                + f"  y against base {diff:.2e}")
        print(line, flush=True)
        res["points"].append({"shape": name, "M": m, "us": med, "segments": z.shape[0], "y_rel_diff": diff})
with open(os.path.join(out, "parts.json"), "w") as f:
    json.dump(res, f, indent=1)
