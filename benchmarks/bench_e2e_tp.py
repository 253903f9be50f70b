"""End-to-end decode under tensor parallelism (torchrun): Escha W2 vs bf16 at TP=N, and Escha at TP=1.

The models are bench_e2e.py's Qwen3-14B-shaped ones (random weights, the same on every rank), built
whole on each rank's GPU and split by ``escha.parallel.parallelize`` along the model's
transformers TP plan: q/k/v and gate/up column-parallel, o and down row-parallel with one
all-reduce each (NCCL), embeddings, norms and lm_head whole on every rank. Both arms use the same
split and the same all-reduces, so they differ only in the Linear layers. Decoding is
bench_e2e.py's: greedy, a StaticCache, each token step captured as a CUDA graph (all-reduces
included), falling back to torch.compile, then eager, if capture fails on any rank.

Arms: ``escha-tp`` and ``bf16-tp`` at TP = the number of ranks; ``escha-tp1`` and ``bf16-tp1``
on rank 0's GPU alone while the other ranks wait (is one GPU enough for the 2-bit model?). A
step's time is the slowest rank's.

    torchrun --nproc-per-node 2 benchmarks/bench_e2e_tp.py --out benchmarks/results/e2e_tp2_h200.json
    torchrun --nproc-per-node 2 benchmarks/bench_e2e_tp.py --tiny --device cpu --new-tokens 4 --repeats 1
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_e2e as e2e  # noqa: E402
from escha.parallel import parallelize  # noqa: E402

# A tiny model every split dimension of which holds two 128-blocks (the CPU smoke test at TP=2).
TINY_TP = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=128, vocab_size=512, max_position_embeddings=512,
               tie_word_embeddings=False)
ARMS = ("bf16-tp", "escha-tp", "escha-tp1", "bf16-tp1")


def setup(args) -> tuple[torch.device, int, int, dist.ProcessGroup]:
    """Join the torchrun group (NCCL on GPUs, gloo on CPU); a gloo group carries the bookkeeping."""
    # Two to eight GPUs need no NVLink multicast for their all-reduces; it stays off on shared hosts.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if args.device == "cuda" else args.device)
    timeout = datetime.timedelta(seconds=args.timeout)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    # Failures and timings are exchanged on gloo, which a failed graph capture cannot disturb.
    ctrl = dist.new_group(backend="gloo", timeout=timeout)
    return device, dist.get_rank(), dist.get_world_size(), ctrl


def measure(model, batch: int, args, device: torch.device, ctrl: dist.ProcessGroup | None) -> dict:
    """One batch size, trying the graphs modes in order until every rank succeeds in one.

    ``ctrl`` None measures this rank alone (the TP=1 arms)."""
    order = [args.graphs] + {"manual": ["compile", "none"], "compile": ["none"], "none": []}[args.graphs]
    world = 1 if ctrl is None else dist.get_world_size(ctrl)
    errors: dict = {}
    for mode in order:
        try:
            times, first = e2e.decode_times(model, batch, args, device, mode)
            mine = (None, times, first)
        except Exception as e:  # capture or compile failed: every rank moves to the next mode together
            mine = (f"{type(e).__name__}: {e}"[:500], None, None)
            if args.verbose:
                traceback.print_exc()
        every = [mine]
        if ctrl is not None:
            every = [None] * world
            dist.all_gather_object(every, mine, group=ctrl)
        failed = {f"rank {r}": err for r, (err, _, _) in enumerate(every) if err is not None}
        if failed:
            errors[mode] = failed
            continue
        best = [min(t) for _, t, _ in every]
        step = max(best)  # a TP step ends when its slowest rank does
        return {"batch": batch, "graphs": mode, "new_tokens": args.new_tokens, "prompt": args.prompt,
                "seconds_per_rank": [t for _, t, _ in every], "tokens_per_s": batch * args.new_tokens / step,
                "ms_per_step": 1e3 * step / args.new_tokens, "first_tokens": every[0][2],
                "ranks_agree": all(f == every[0][2] for _, _, f in every), "fallback_errors": errors}
    raise RuntimeError(f"every decode mode failed: {errors}")


def run_arm(arm: str, config, args, device: torch.device, rank: int, ctrl: dist.ProcessGroup) -> dict | None:
    """Build, split (TP arms) and measure one arm; rank 0 returns its rows, the others None."""
    kind, tp = arm.split("-")
    rows, mem = [], None
    if tp == "tp" or rank == 0:
        model = e2e.build(config, kind, device, args.bits)
        if tp == "tp":
            parallelize(model)
        e2e.free_memory(device)
        if device.type == "cuda":
            mem = torch.cuda.memory_allocated(device)
        for b in args.batch_list:
            rows.append(measure(model, b, args, device, ctrl if tp == "tp" else None))
            if rank == 0:
                r = rows[-1]
                print(f"{arm:9s} batch {b}: {r['tokens_per_s']:.1f} tok/s ({r['ms_per_step']:.2f} ms/step, "
                      f"graphs={r['graphs']})", flush=True)
        del model
        e2e.free_memory(device)
    mems = [None] * dist.get_world_size(ctrl)
    dist.all_gather_object(mems, mem, group=ctrl)  # also keeps idle ranks in step with rank 0
    if rank != 0:
        return None
    ranks = dist.get_world_size(ctrl) if tp == "tp" else 1
    return {"tp": ranks, "rows": rows, "weights_bytes_on_device_per_rank": mems[:ranks]}


def comparisons(arms: dict) -> dict:
    """tokens/s ratios per batch: Escha against bf16 at equal TP, and Escha at TP=1 against bf16 at TP=N."""
    out = {}
    for name, (a, b) in {"escha_tp_over_bf16_tp": ("escha-tp", "bf16-tp"),
                         "escha_tp1_over_bf16_tp": ("escha-tp1", "bf16-tp"),
                         "escha_tp_over_escha_tp1": ("escha-tp", "escha-tp1")}.items():
        if a in arms and b in arms:
            out[name] = {str(ra["batch"]): ra["tokens_per_s"] / rb["tokens_per_s"]
                         for ra, rb in zip(arms[a]["rows"], arms[b]["rows"])}
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (each rank takes cuda:LOCAL_RANK) or cpu (gloo)")
    ap.add_argument("--tiny", action="store_true",
                    help="a 2-layer model every split of which fits TP=2 (CPU smoke test)")
    ap.add_argument("--timeout", type=float, default=1800, help="collective timeout, seconds")
    return e2e.common_arguments(ap, "bf16-tp,escha-tp,escha-tp1")


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    unknown = [a for a in args.arms.split(",") if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    if "WORLD_SIZE" not in os.environ:
        ap.error("run under torchrun, e.g. torchrun --nproc-per-node 2 benchmarks/bench_e2e_tp.py")
    if args.graphs is None:
        args.graphs = "manual" if args.device == "cuda" else "none"
    if args.graphs != "none" and args.device != "cuda":
        ap.error("CUDA graphs need --device cuda")
    args.batch_list = [int(b) for b in args.batches.split(",")]
    device, rank, world, ctrl = setup(args)
    try:
        shape = dict(TINY_TP if args.tiny else e2e.QWEN3_14B)
        if args.layers:
            shape["num_hidden_layers"] = args.layers
        config = e2e.make_config(shape)
        arms = {}
        for arm in args.arms.split(","):
            result = run_arm(arm, config, args, device, rank, ctrl)
            if rank == 0:
                arms[arm] = result
        if rank == 0:
            results = {
                "benchmark": "e2e decode, tensor parallel", "world_size": world,
                "backend": dist.get_backend(), "arms": arms, "tokens_per_s_ratios": comparisons(arms),
                "model": "tiny Qwen3 (smoke test)" if args.tiny else "Qwen3-14B-shaped (random weights)",
                "config": shape, "bits": args.bits,
                "split": "escha.parallel.parallelize along the model's transformers TP plan: q/k/v, gate/up "
                         "column-parallel; o, down row-parallel (one all-reduce each); embeddings, norms, "
                         "lm_head whole on every rank; bf16 and Escha arms split alike",
                "weights": "random, as bench_e2e.py: bf16 from transformers' init, Escha from "
                           "escha.format.random_qweight; the same on every rank",
                "machine": e2e.machine(device),
            }
            ratios = results["tokens_per_s_ratios"]
            print("ratios:", {k: {b: round(v, 3) for b, v in r.items()} for k, r in ratios.items()})
            if args.out:
                e2e.write_results(results, args.out)
                print(f"wrote {args.out}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
