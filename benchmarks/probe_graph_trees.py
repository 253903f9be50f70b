"""escha.matmul under CUDA-graph trees (torch.compile(mode="reduce-overhead")) with its weight held
outside any module, so that the trees take the weight's tensors as inputs to copy into their pool
on every call. One compiled step per (tokens, path), called four times (warm-up, recording,
replays) and compared bit for bit with the eager call; a step the trees refuse prints their error.

``--no-plans`` stops the dequantize-once paths from keeping their prepared launches
(``dequant_once.weight_plans`` returns a new dict a call): the launches keep the weight tensors
they were first given (benchmarks/results/h100_5550e90/README.md).

    python benchmarks/probe_graph_trees.py [--no-plans]     # a Hopper GPU
"""
import argparse

import torch
import torch._dynamo
import torch._inductor.config

import escha
import escha.kernels.dequant_once as dequant_once
from escha.format import random_qweight

CASES = ((600, None), (600, "dequant-bf16"), (600, "prefill"), (2000, "dequant-fp8"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-plans", action="store_true")
    args = ap.parse_args()
    torch._inductor.config.triton.cudagraph_trees_history_recording = True
    if args.no_plans:
        dequant_once.weight_plans = lambda qw: {}
    for i, (m, path) in enumerate(CASES):
        torch._dynamo.reset()
        qw = random_qweight(1152 + 128 * (i + 7), 2432, 2, seed=90 + i, device="cuda")
        x = torch.randn(m, 2432, device="cuda", dtype=torch.bfloat16)
        step = torch.compile(lambda t: escha.matmul(t, qw, path=path), mode="reduce-overhead")
        try:
            outs = [step(x).clone() for _ in range(4)]
            print(m, path, "OK", all(torch.equal(o, escha.matmul(x, qw, path=path)) for o in outs), flush=True)
        except Exception as e:  # the trees' refusal: print it and go on to the next case
            lines = str(e).splitlines()
            print(m, path, "FAILED", lines[0], flush=True)
            print("\n".join(line for line in lines if "escha" in line or "Data Pointer" in line), flush=True)


if __name__ == "__main__":
    main()
