"""Decode speed through transformers' own ``model.generate``, as users call it: Escha W2 vs bf16.

The model is bench_e2e.py's Qwen3-14B-shaped one (random weights; ``--layers`` decoder layers).
Three ways to decode the same greedy tokens, each timed on the same model in one process:

* ``generate``: ``model.generate(ids, do_sample=False)``, transformers' default (a DynamicCache,
  every step run eagerly);
* ``generate-static``: the same with ``cache_implementation="static"``, for which transformers
  compiles the decode step itself (``torch.compile(mode="reduce-overhead")``: CUDA graphs);
* ``graphs``: bench_e2e.py's loop, one step captured by hand as a CUDA graph (the ceiling).

Greedy with no end-of-sequence token, every call makes ``--new-tokens`` tokens. A generate
call's time per token leaves out its prompt: a stopping criterion synchronizes and
reads the clock once, after ``--skip`` tokens, and the call's end is read after it returns:
(end - mark) / (new tokens - skip). The first generate call of each form is a warm-up (for the
static form, the compile); its seconds are recorded as ``first_call_s``.

    python benchmarks/bench_generate.py --device cuda --layers 12 --out generate.json
    python benchmarks/bench_generate.py --tiny --device cpu --new-tokens 6 --skip 2   # CPU smoke
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_e2e  # noqa: E402

FORMS = ("generate", "generate-static", "graphs")


class Clock:
    """A stopping criterion that never stops: on its ``skip``-th call (one a new token) it waits
    for the device and reads the clock."""

    def __init__(self, skip: int, device: torch.device):
        self.skip, self.device, self.calls, self.mark = skip, device, 0, None

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.skip:
            bench_e2e.sync(self.device)
            self.mark = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_once(model, ids: torch.Tensor, form: str, args, device: torch.device) -> tuple[float, float, list]:
    """One generate call: its whole seconds, its seconds a token after ``skip`` tokens, the tokens."""
    from transformers import StoppingCriteriaList
    clock = Clock(args.skip, device)
    extra = {"cache_implementation": "static"} if form == "generate-static" else {}
    bench_e2e.sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                             do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), **extra)
    bench_e2e.sync(device)
    end = time.perf_counter()
    if clock.mark is None:
        raise RuntimeError(f"the clock never ran: {clock.calls} steps for --skip {args.skip}")
    return end - start, (end - clock.mark) / (args.new_tokens - args.skip), out[0, ids.shape[1]:].tolist()


def greedy_model(config, arm: str, device: torch.device, bits: int):
    """bench_e2e.py's model of ``arm``, set to decode greedily to the end: random weights may pick
    the end-of-sequence token."""
    model = bench_e2e.build(config, arm, device, bits)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def batch_prompt(model, batch: int, args, device: torch.device) -> torch.Tensor:
    """bench_e2e.py's fixed random prompt of ``--prompt`` tokens, once a row of the batch."""
    return bench_e2e.prompt_ids(model, args.prompt, device).expand(batch, -1).contiguous()


def measure_generate(model, batch: int, form: str, args, device: torch.device) -> dict:
    import torch._dynamo
    ids = batch_prompt(model, batch, args, device)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first_s, _, _ = generate_once(model, ids, form, args, device)  # warm-up; the compile for the static form
    compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # this form traced a graph
    per_token, tokens = [], None
    for _ in range(args.repeats):
        _, s, tokens = generate_once(model, ids, form, args, device)
        per_token.append(s)
    best = min(per_token)
    return {"form": form, "batch": batch, "new_tokens": args.new_tokens, "skip": args.skip, "prompt": args.prompt,
            "first_call_s": first_s, "seconds_per_token": per_token, "ms_per_step": 1e3 * best,
            "tokens_per_s": batch / best, "median_ms_per_step": 1e3 * statistics.median(per_token),
            "compiled": compiled, "tokens": tokens}


def profile_generate(model, batch: int, form: str, args, device: torch.device, top: int = 12) -> dict:
    """One more generate call of ``form`` under the torch profiler: its GPU kernels' summed
    durations against the call's wall time (a step whose kernels take less than its wall time
    waits on the host), and the CPU operators with the most self time."""
    from torch.profiler import ProfilerActivity, profile
    ids = batch_prompt(model, batch, args, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall, _, _ = generate_once(model, ids, form, args, device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_us = sum(e.time_range.elapsed_us() for e in kernels)
    cpu = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    return {"wall_ms_under_profiler": 1e3 * wall, "gpu_kernel_ms": gpu_us / 1e3, "kernels": len(kernels),
            "gpu_kernel_ms_per_token": gpu_us / 1e3 / args.new_tokens,
            "top_cpu_self_ms": {a.key: a.self_cpu_time_total / 1e3 for a in cpu},
            "note": "one generate call (prompt included) under torch.profiler; kernel times are GPU durations"}


def measure_graphs(model, batch: int, args, device: torch.device) -> dict:
    """bench_e2e.py's hand-captured graph over the same prompt length and token count."""
    times, first = bench_e2e.decode_times(model, batch, args, device, "manual")
    best = min(times) / args.new_tokens
    return {"form": "graphs", "batch": batch, "new_tokens": args.new_tokens, "prompt": args.prompt,
            "seconds_per_token": [t / args.new_tokens for t in times], "ms_per_step": 1e3 * best,
            "tokens_per_s": batch / best, "first_tokens": first}


def agreement(a: list, b: list) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-128 model (CPU smoke test)")
    ap.add_argument("--forms", default=None, help=f"comma-separated, of {', '.join(FORMS)} "
                                                  "(default: all on CUDA, generate on CPU)")
    ap.add_argument("--skip", type=int, default=8, help="tokens each timed generate call makes before its clock starts")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each generate form, one more call under the torch profiler (GPU kernel "
                         "time a token against the measured step: what of a step is host work)")
    ap = bench_e2e.common_arguments(ap, "bf16,escha")  # its --prefill and --graphs do not apply here
    ap.set_defaults(batches="1", new_tokens=136, repeats=3)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    forms = (args.forms or (",".join(FORMS) if device.type == "cuda" else "generate")).split(",")
    if bad := [f for f in forms if f not in FORMS]:
        ap.error(f"unknown form {bad[0]!r}: choose from {', '.join(FORMS)}")
    if device.type != "cuda" and set(forms) - {"generate"}:
        ap.error("generate-static and graphs need --device cuda (transformers compiles on accelerators only)")
    if not 0 < args.skip < args.new_tokens:
        ap.error(f"--skip must lie between 0 and --new-tokens ({args.new_tokens}), exclusive")
    shape = bench_e2e.model_shape(args)
    config = bench_e2e.make_config(shape)
    batches = [int(b) for b in args.batches.split(",")]
    arms: dict = {}
    for arm in args.arms.split(","):
        model = greedy_model(config, arm, device, args.bits)
        rows = []
        for b in batches:
            for form in forms:
                try:
                    row = measure_graphs(model, b, args, device) if form == "graphs" else \
                        measure_generate(model, b, form, args, device)
                except Exception as e:  # a form that fails is recorded, and the others still run
                    row = {"form": form, "batch": b, "error": f"{type(e).__name__}: {e}"[:800]}
                    print(f"{arm:6s} batch {b} {form}: FAILED {row['error']}", flush=True)
                    rows.append(row)
                    continue
                if args.profile and form != "graphs":
                    row["profile"] = profile_generate(model, b, form, args, device)
                    print(f"{arm:6s} batch {b} {form:16s}: profiled, {row['profile']['gpu_kernel_ms_per_token']:.2f} ms "
                          f"of GPU kernels a token", flush=True)
                rows.append(row)
                print(f"{arm:6s} batch {b} {form:16s}: {row['tokens_per_s']:8.1f} tok/s "
                      f"({row['ms_per_step']:.2f} ms/step"
                      + (f", first call {row['first_call_s']:.1f} s, compiled={row['compiled']}" if "first_call_s" in row else "")
                      + ")", flush=True)
        plain = {r["batch"]: r["tokens"] for r in rows if r.get("form") == "generate" and "tokens" in r}
        for r in rows:
            if r.get("form") == "generate-static" and "tokens" in r and r["batch"] in plain:
                r["tokens_shared_with_generate"] = agreement(r["tokens"], plain[r["batch"]])
        arms[arm] = {"rows": rows}
        del model
        bench_e2e.free_memory(device)
    results: dict = {"benchmark": "decode through transformers' generate", "arms": arms}
    if {"bf16", "escha"} <= set(arms):
        def rate(arm, form, b):
            return next((r["tokens_per_s"] for r in arms[arm]["rows"]
                         if r.get("form") == form and r["batch"] == b and "tokens_per_s" in r), None)
        results["escha_over_bf16"] = {
            form: {str(b): (rate("escha", form, b) / rate("bf16", form, b))
                   for b in batches if rate("escha", form, b) and rate("bf16", form, b)} for form in forms}
        print("escha / bf16 tokens/s:", {f: {k: round(v, 3) for k, v in d.items()}
                                         for f, d in results["escha_over_bf16"].items()})
    results.update({"model": "Qwen3-14B-shaped (random weights)" if not args.tiny else "tiny Qwen3 (smoke test)",
                    "config": shape, "layers": config.num_hidden_layers, "bits": args.bits,
                    "machine": bench_e2e.machine(device)})
    if args.out:
        bench_e2e.write_results(results, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
