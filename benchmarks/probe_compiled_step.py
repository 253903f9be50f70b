"""The host time of a compiled decode step spent outside its compiled graph, and the graph's inputs.

transformers' ``generate(cache_implementation="static")`` compiles the model's step
(``torch.compile``; ``mode="reduce-overhead"`` on a GPU). Each call of the compiled step first
checks the guards Dynamo installed, then hands the graph its inputs (every parameter and buffer
it reads, one by one), and only then runs the graph. This probe times each decode step's call of
the compiled step and, inside it, the compiled graph's own call; the difference is the host work
around the graph, which a CUDA-graph replay does not hide. It also counts the graph's inputs and, with
``--guards``, the guards Dynamo installed on the step, by kind (one tree of checks, walked at each
call before the graph runs).

One process per arm (a second compile in one process is slower: Dynamo's caches of the first
stay): the script runs itself once per arm and prints a table; ``--out`` writes JSON.

    python benchmarks/probe_compiled_step.py --tiny --layers 8 --device cpu     # CPU: compile on the CPU
    python benchmarks/probe_compiled_step.py --layers 40                       # a GPU: the 14B-shaped model
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_e2e  # noqa: E402
import bench_generate  # noqa: E402


class _GuardTrees(logging.Handler):
    """Keeps each guard tree Dynamo logs (its "guards" artifact: one message a compiled frame)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.trees: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.trees.append(record.getMessage())


def count_guards(tree: str) -> dict[str, int]:
    """Guards of one logged tree by kind (``+- TENSOR_MATCH: ...``; the accessors are not counted)."""
    return dict(collections.Counter(re.findall(r"\+- ([A-Z][A-Z_]+):", tree)).most_common())


def measure(arm: str, args) -> dict:
    """Generate twice with a static cache (compile, then measure) and time the second's steps
    (with ``args.guards``, also count the step's guards)."""
    trees = None
    if getattr(args, "guards", False):
        trees = _GuardTrees()
        logger = logging.getLogger("torch._dynamo.guards.__guards")
        logger.addHandler(trees)
        torch._logging.set_logs(guards=True)
        try:
            return _measure(arm, args, trees)
        finally:
            logger.removeHandler(trees)
            torch._logging.set_logs()
    return _measure(arm, args, trees)


def _measure(arm: str, args, trees: _GuardTrees | None) -> dict:
    import torch._inductor.output_code as output_code
    from transformers import CompileConfig

    device = torch.device(args.device)
    shape = bench_e2e.model_shape(args)
    model = bench_generate.greedy_model(bench_e2e.make_config(shape), arm, device, 2)
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' own switch: on the CPU too
    ids = torch.randint(0, 100, (1, 8), device=device)
    kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
              compile_config=config, cache_implementation="static")
    graph_s: list[float] = []
    step_s: list[float] = []
    inputs: list[int] = []
    graph_call = output_code.CompiledFxGraph.__call__

    def timed_graph(self, *a, **k):
        inputs.append(len(a[0]) if a and isinstance(a[0], (list, tuple)) else -1)
        t0 = time.perf_counter()
        out = graph_call(self, *a, **k)
        graph_s.append(time.perf_counter() - t0)
        return out

    with torch.no_grad():
        model.generate(ids, **kw)  # compiles (and, on a GPU, records the CUDA graphs)
        step = model.get_compiled_call(config)

        def timed_step(*a, **k):
            t0 = time.perf_counter()
            out = step(*a, **k)
            step_s.append(time.perf_counter() - t0)
            return out

        model.get_compiled_call = lambda *a, **k: timed_step
        output_code.CompiledFxGraph.__call__ = timed_graph
        try:
            model.generate(ids, **kw)
        finally:
            output_code.CompiledFxGraph.__call__ = graph_call
    if len(step_s) != len(graph_s):
        raise RuntimeError(f"{len(step_s)} step calls but {len(graph_s)} graph calls: a graph break splits the step")
    outside = [1e6 * (s - g) for s, g in zip(step_s, graph_s)]
    row = {"arm": arm, "layers": shape["num_hidden_layers"], "steps": len(outside),
           "outside_graph_us_median": statistics.median(outside), "outside_graph_us_min": min(outside),
           "graph_call_us_median": 1e6 * statistics.median(graph_s), "graph_inputs": inputs[-1]}
    if trees is not None:
        if not trees.trees:
            raise RuntimeError("no guard tree was logged")
        kinds = max((count_guards(t) for t in trees.trees), key=lambda k: sum(k.values()))  # the step's frame
        row["guards"] = sum(kinds.values())
        row["guards_by_kind"] = kinds
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a hidden-128 model (the CPU's size)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--arms", default="bf16,escha,escha-unshared")
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--guards", action="store_true", help="count the step's guards by kind")
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one arm, JSON out
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.arms, args)))
        return 0
    rows = []
    for arm in args.arms.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--one", "--arms", arm, "--device", args.device,
               "--new-tokens", str(args.new_tokens)] + (["--tiny"] if args.tiny else []) \
            + (["--guards"] if args.guards else []) \
            + ([] if args.layers is None else ["--layers", str(args.layers)])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{arm:15s} layers {r['layers']:3d}: outside the graph {r['outside_graph_us_median']:8.0f} us a step "
              f"(min {r['outside_graph_us_min']:.0f}), graph call {r['graph_call_us_median']:8.0f} us, "
              f"{r['graph_inputs']} graph inputs" + (f", {r['guards']} guards" if "guards" in r else ""), flush=True)
    if args.out:
        import platform

        import transformers

        from escha.bench.report import build_meta
        gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
        meta = build_meta(gpu=gpu, driver="", extra={"transformers": transformers.__version__,
                                                     "device": args.device, "new_tokens": args.new_tokens,
                                                     "model": "tiny Qwen3" if args.tiny else "Qwen3-14B-shaped"})
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
