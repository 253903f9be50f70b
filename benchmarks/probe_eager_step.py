"""Where an eager decode step's host time goes: transformers' ``generate`` (DynamicCache, no
graphs) on bench_e2e.py's Qwen3-14B-shaped model, escha against bf16, in one process.

For each arm: one warm-up ``generate`` call, then ``--repeats`` timed calls (bench_generate.py's
clock: ms a step after ``--skip`` tokens), then one call under cProfile (its functions by own
and by inclusive time, per generated token) and one with ``torch.cuda.set_sync_debug_mode("warn")``
(every host synchronization the step makes, by where it was made). Run it under ``py-spy
record --format raw`` for a sampled view as well: the profiled calls run inside
``profiled_call``, the timed ones inside ``timed_call``, so their stacks can be told apart.

    python benchmarks/probe_eager_step.py --device cuda --layers 12 --out eager_step/
    python benchmarks/probe_eager_step.py --tiny --device cpu --new-tokens 6 --skip 2 --out /tmp/e  # CPU smoke
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_e2e  # noqa: E402
import bench_generate  # noqa: E402


def timed_call(model, ids, args, device) -> float:
    """One eager generate call: ms a step after ``--skip`` tokens."""
    return 1e3 * bench_generate.generate_once(model, ids, "generate", args, device)[1]


def profiled_call(model, ids, args, device, top: int) -> dict:
    """One eager generate call under cProfile: the ``top`` functions by own time and by inclusive
    time, in µs per generated token (cProfile's own cost inflates small functions)."""
    prof = cProfile.Profile()
    prof.enable()
    bench_generate.generate_once(model, ids, "generate", args, device)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, inclusive, _) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}({name})", "calls_per_token": calls / args.new_tokens,
                     "own_us_per_token": 1e6 * own / args.new_tokens,
                     "inclusive_us_per_token": 1e6 * inclusive / args.new_tokens})
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return {"by_own": sorted(rows, key=lambda r: -r["own_us_per_token"])[:top],
            "by_inclusive": sorted(rows, key=lambda r: -r["inclusive_us_per_token"])[:top],
            "text": text.getvalue()}


def synchronizations(model, ids, args, device) -> dict:
    """The host synchronizations of one eager generate call, counted by the innermost frames
    outside torch that made them (CUDA only: the sync debug mode)."""
    if device.type != "cuda":
        return {"note": "CUDA only"}
    seen: dict[str, int] = {}

    def note(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/torch/" not in f.filename and "warnings" not in f.filename][-3:]
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}({f.name})" for f in reversed(frames))
        seen[key] = seen.get(key, 0) + 1

    with warnings.catch_warnings():  # restores the filters and showwarning on leaving
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            bench_generate.generate_once(model, ids, "generate", args, device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return {"per_call": sum(seen.values()), "new_tokens": args.new_tokens,
            "by_site": dict(sorted(seen.items(), key=lambda kv: -kv[1]))}


def main(argv: list[str] | None = None) -> int:
    ap = bench_generate.parser()
    ap.description = __doc__.splitlines()[0]
    ap.add_argument("--top", type=int, default=40, help="functions kept from each cProfile ordering")
    ap.set_defaults(new_tokens=40, repeats=3)
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    config = bench_e2e.make_config(bench_e2e.model_shape(args))
    results = {"machine": bench_e2e.machine(device), "layers": args.layers, "new_tokens": args.new_tokens,
               "skip": args.skip, "arms": {}}
    for arm in args.arms.split(","):
        model = bench_generate.greedy_model(config, arm, device, args.bits)
        ids = bench_generate.batch_prompt(model, 1, args, device)
        timed_call(model, ids, args, device)  # warm-up: compiles kernels, makes launch plans
        ms = [timed_call(model, ids, args, device) for _ in range(args.repeats)]
        row = {"ms_per_step": ms, "profile": profiled_call(model, ids, args, device, args.top),
               "synchronizations": synchronizations(model, ids, args, device)}
        with open(os.path.join(args.out, f"cprofile_{arm}.txt"), "w") as f:
            f.write(row["profile"].pop("text"))
        results["arms"][arm] = row
        print(f"{arm:6s} eager generate: {min(ms):.2f} ms a step (best of {len(ms)}), "
              f"{row['synchronizations'].get('per_call', 'n/a')} synchronizations a call", flush=True)
        del model
        bench_e2e.free_memory(device)
    with open(os.path.join(args.out, "eager_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
