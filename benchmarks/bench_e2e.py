"""End-to-end decode throughput: a Qwen3-14B-shaped model, Escha W2 vs bf16, batch 1 and 8.

Weights are random: the bf16 arm uses transformers' initialisation, the Escha arm replaces every
Linear inside the decoder layers with an EschaLinear whose trellis bits, signs and scales come
from ``escha.format.random_qweight`` (valid weights that cost nothing to make; decode speed does
not depend on the values). Embeddings, norms and lm_head are bf16 in both arms.

Decoding runs greedy with a StaticCache; each token step is captured once as a CUDA graph
(``--graphs manual``, default), or compiled with torch.compile(mode="reduce-overhead")
(``--graphs compile``), or run eagerly (``--graphs none``, the only choice on CPU). If capture
fails the script falls back (manual -> compile -> none) and records what ran. Decoding through
transformers' own ``generate`` (eager, and with a static cache, which transformers compiles) is
``bench_generate.py``'s.

    python benchmarks/bench_e2e.py --device cuda --out benchmarks/results/e2e_h200.json
    python benchmarks/bench_e2e.py --tiny --device cpu --new-tokens 4   # CPU smoke test
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import escha  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402
from escha.format import random_qweight  # noqa: E402
from escha.format.shard import row_offsets, split_rows  # noqa: E402
from escha.kernels.decode_wgmma import plan_count  # noqa: E402
from escha.nn import EschaLinear, fuse_projections, replace_linear  # noqa: E402

QWEN3_14B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                 rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False)
# Linears of one module that read one input, in call order (Qwen3: attention, MLP); o_proj and
# down_proj read their own.
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
            tie_word_embeddings=False)


def model_shape(args) -> dict:
    """The Qwen3Config arguments of the benchmarked model (recorded as they are in the results)."""
    shape = dict(TINY if args.tiny else QWEN3_14B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return shape


def make_config(shape: dict):
    import transformers
    return transformers.Qwen3Config(**shape)


def build(config, arm: str, device: torch.device, bits: int):
    """The bf16 model, or the same model with Escha W2 Linears in every decoder layer: "escha" with
    q/k/v and gate/up each run as one product (escha.nn.share_inputs) that applies the RMSNorm
    before it (escha.nn.fold_norms), "escha-unshared" with one product per Linear and the norms
    as the model has them."""
    import transformers
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        if arm == "bf16":
            with device:
                model = transformers.Qwen3ForCausalLM(config)
        else:
            from escha.model.checkpoint import meta_parameters
            with meta_parameters():
                model = transformers.Qwen3ForCausalLM(config)
            for name, p in list(model.named_parameters()):
                if ".layers." in name and name.endswith("_proj.weight"):
                    continue  # replaced below
                value = torch.ones(p.shape, device=device) if p.dim() == 1 else torch.randn(p.shape, device=device) * 0.02
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            # Projections that read one input get one stacked random weight, split by rows: what
            # escha quantize gives them (escha.quant.quantize_shared), so that they can share one product.
            seed = 0
            for parent_name, parent in list(model.named_modules()):
                if ".layers." not in parent_name + ".":
                    continue
                for names in SHARED_INPUTS:
                    mods = [getattr(parent, n, None) for n in names]
                    if not all(isinstance(m, torch.nn.Linear) for m in mods):
                        continue
                    stacked = random_qweight(row_offsets([m.out_features for m in mods])[-1] + mods[-1].out_features,
                                             mods[0].in_features, bits=bits, seed=seed, device=device)
                    seed += 1
                    for n, m, part in zip(names, mods, split_rows(stacked, [m.out_features for m in mods])):
                        setattr(parent, n, EschaLinear.from_quantized(part.clone()))
            for name, mod in list(model.named_modules()):  # any other Linear of the layers, alone
                if isinstance(mod, torch.nn.Linear) and ".layers." in name:
                    qw = random_qweight(mod.out_features, mod.in_features, bits=bits, seed=seed, device=device)
                    replace_linear(model, name, EschaLinear.from_quantized(qw))
                    seed += 1
            model.to(device)
            if arm == "escha":  # as escha.load_model does; "escha-unshared" keeps one product per Linear
                fuse_projections(model)
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


class Decoder:
    """Greedy decoding with a StaticCache; ``step`` is one token for the whole batch."""

    def __init__(self, model, batch: int, prompt: int, new_tokens: int, device: torch.device, graphs: str):
        from transformers import StaticCache
        self.model, self.device = model, device
        self.prompt_ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device,
                                        generator=torch.Generator(device=device).manual_seed(1))
        self.cache = StaticCache(config=model.config, max_cache_len=prompt + new_tokens + 4)
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.prompt = prompt
        self.graph = None
        self.mode = graphs
        # Under torch.compile only the forward is compiled: the token and position updates stay
        # outside, since CUDA-graph trees skip a graph that mutates its inputs.
        self.forward = self._forward
        if graphs == "compile":
            self.forward = torch.compile(self._forward, mode="reduce-overhead", fullgraph=False)
        self.fn = self._step

    def _forward(self):
        out = self.model(input_ids=self.tok, position_ids=self.pos, cache=self.cache, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def _step(self):
        nxt = self.forward()
        self.tok.copy_(nxt)
        self.pos.add_(1)
        return nxt

    def prefill(self) -> None:
        self.cache.reset()
        b = self.prompt_ids.shape[0]
        pos = torch.arange(self.prompt, device=self.device).expand(b, -1)
        out = self.model(input_ids=self.prompt_ids, position_ids=pos, cache=self.cache, use_cache=True)
        self.tok.copy_(out.logits[:, -1].argmax(-1, keepdim=True))
        self.pos.fill_(self.prompt)

    def prepare(self) -> None:
        """Warm up (and capture the graph, in manual mode), leaving the cache freshly prefilled."""
        self.prefill()
        if self.mode == "manual":
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    self._step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
        else:
            for _ in range(3):
                self.fn()
        self.prefill()

    def run(self, n: int) -> list[torch.Tensor]:
        tokens = []
        for _ in range(n):
            if self.graph is not None:
                self.graph.replay()
                tokens.append(self.tok.clone())
            else:
                tokens.append(self.fn().clone())
        return tokens


def free_memory(device: torch.device) -> None:
    """Collect what the caller dropped (a model between arms, weights replaced by their shards) and
    return the allocator's cached blocks, so that the next arm's memory figures and allocations
    start clean."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_times(model, batch: int, args, device: torch.device, mode: str) -> tuple[list[float], list[int]]:
    """The decode loop in one graphs mode: the repeats' seconds and the first tokens."""
    dec = Decoder(model, batch, args.prompt, args.new_tokens, device, mode)
    with torch.no_grad():
        dec.prepare()
        times = []
        for _ in range(args.repeats):
            dec.prefill()
            sync(device)
            t = time.perf_counter()
            toks = dec.run(args.new_tokens)
            sync(device)
            times.append(time.perf_counter() - t)
    return times, torch.cat(toks[:4], 1)[0].tolist()


def measure(model, batch: int, args, device: torch.device) -> dict:
    order = [args.graphs] + {"manual": ["compile", "none"], "compile": ["none"], "none": []}[args.graphs]
    errors = {}
    for mode in order:
        try:
            times, first = decode_times(model, batch, args, device, mode)
            best = min(times)
            return {"batch": batch, "graphs": mode, "new_tokens": args.new_tokens, "prompt": args.prompt,
                    "seconds": times, "tokens_per_s": batch * args.new_tokens / best,
                    "ms_per_step": 1e3 * best / args.new_tokens,
                    "first_tokens": first, "fallback_errors": errors, "decode_plans": plan_count()}
        except Exception as e:  # capture or compile failed: record and try the next mode
            errors[mode] = f"{type(e).__name__}: {e}"[:500]
            if args.verbose:
                traceback.print_exc()
    raise RuntimeError(f"every decode mode failed: {errors}")


def prompt_ids(model, tokens: int, device: torch.device) -> torch.Tensor:
    """The fixed random prompt [1, tokens] that the prompt timings and profiles run."""
    return torch.randint(0, model.config.vocab_size, (1, tokens), device=device,
                         generator=torch.Generator(device=device).manual_seed(2))


def prefill_times(model, tokens: int, args, device: torch.device) -> dict:
    """One prompt of ``tokens`` tokens through the whole model (batch 1, no cache: the forward a
    prompt costs before its first new token), eager, after two warm-up passes; best of the
    repeats. escha's Linears take their prompt-length paths here (dequantize-once past 128 tokens)."""
    ids = prompt_ids(model, tokens, device)
    times = []
    with torch.no_grad():
        for i in range(2 + args.repeats):
            sync(device)
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            sync(device)
            if i >= 2:
                times.append(time.perf_counter() - t)
    best = min(times)
    return {"prompt_tokens": tokens, "seconds": times, "ms": 1e3 * best, "tokens_per_s": tokens / best}


# The kernels of an escha.matmul call, by role (their Triton names; the profiler reports those).
ESCHA_GEMMS = ("_decode_wgmma_kernel", "_decode_kernel", "prefill_kernel", "dequant_hn_kernel", "_dequant_kernel")
ESCHA_TRANSFORMS = ("_input_transform_kernel", "_output_transform_kernel", "_output_hadamard_kernel")


def kernel_role(name: str) -> str:
    """'escha GEMM', 'escha transform' or 'other' (cuBLAS, attention, norms, elementwise)."""
    if name.startswith(ESCHA_GEMMS):
        return "escha GEMM"
    if name.startswith(ESCHA_TRANSFORMS):
        return "escha transform"
    return "other"


def host_syncs(dec, device: torch.device) -> dict:
    """Operations of one eager decode step that make the host wait for the GPU (CUDA's sync debug
    mode: a copy to the host, ``.item()``, ...): their count and first messages. One would make
    an eager step's host and GPU times add up instead of overlapping."""
    import warnings
    if device.type != "cuda":
        return {"count": None, "first": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            dec._step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(device)
    found = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return {"count": len(found), "first": found[:5]}


def launch_profile(model, batch: int, args, device: torch.device) -> dict:
    """One decode step (eager, after a warm-up step) under the torch profiler: the GPU kernels it
    launches and their time by role, and its escha.matmul calls. A graph replays the same kernels."""
    from torch.profiler import ProfilerActivity, profile
    dec = Decoder(model, batch, args.prompt, 4, device, "none")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad():
        dec.prefill()
        dec._step()
        sync(device)
        syncs = host_syncs(dec, device)
        with profile(activities=activities) as prof:
            dec._step()
            sync(device)
    roles: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = roles.setdefault(kernel_role(e.name), {"launches": 0, "us": 0.0})
            r["launches"] += 1
            r["us"] += e.time_range.elapsed_us()
    calls = sum(1 for e in prof.events() if e.name == "escha::matmul" and e.device_type == torch.autograd.DeviceType.CPU)
    total = sum(r["us"] for r in roles.values())
    gemm = roles.get("escha GEMM", {}).get("us", 0.0)
    return {"batch": batch, "escha_matmul_calls": calls, "host_syncs": syncs,
            "kernel_launches": sum(r["launches"] for r in roles.values()), "by_role": roles,
            "kernel_us": total, "kernel_us_outside_escha_gemms": total - gemm,
            "note": "one eager decode step (batch tokens) under torch.profiler; times are GPU kernel durations"}


def prefill_profile(model, tokens: int, device: torch.device, top: int = 20) -> dict:
    """One prompt's forward (eager, after a warm-up pass) under the torch profiler: wall time, the
    GPU kernel time by name and the CPU operators with the most self time (where a prompt's time
    goes when it is not in the GPU's kernels)."""
    from torch.profiler import ProfilerActivity, profile
    ids = prompt_ids(model, tokens, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        sync(device)
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            sync(device)
            wall = time.perf_counter() - t
    kernels: dict = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], {"launches": 0, "us": 0.0})
            k["launches"] += 1
            k["us"] += e.time_range.elapsed_us()
    cpu = sorted(((a.key, a.self_cpu_time_total, a.count) for a in prof.key_averages()), key=lambda r: -r[1])
    return {"prompt_tokens": tokens, "wall_ms_under_profiler": 1e3 * wall,
            "gpu_kernel_us": sum(k["us"] for k in kernels.values()),
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])[:top]),
            "cpu_self_us": [{"op": k, "self_us": us, "count": n} for k, us, n in cpu[:top]],
            "note": "one eager forward under torch.profiler (its own overhead included in the wall time)"}


def machine(device: torch.device) -> dict:
    """Where and with what the run happened (the commit: escha.bench.report.git_sha)."""
    info = {"platform": platform.platform(), "torch": torch.__version__, "escha": escha.__version__,
            "transformers": __import__("transformers").__version__, "git_sha": git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def common_arguments(ap: argparse.ArgumentParser, arms: str) -> argparse.ArgumentParser:
    """The options this script shares with bench_e2e_tp.py (after its --device and --tiny)."""
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: 40, as Qwen3-14B)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill", default="",
                    help="comma-separated prompt lengths to time as one forward each (time to first token); "
                         "empty: none")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bits", type=int, default=2)
    ap.add_argument("--graphs", choices=("manual", "compile", "none"), default=None)
    ap.add_argument("--arms", default=arms)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--out", default=None)
    return ap


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-128 model (CPU smoke test)")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the profiled step (kernel launches and their time by role)")
    ap.add_argument("--profile-prefill", default="",
                    help="comma-separated prompt lengths to profile as one forward each (kernel and CPU time)")
    return common_arguments(ap, "bf16,escha")


def summarize(arms: dict, args, shape: dict, config, device: torch.device) -> dict:
    """The results document: each arm's rows, the escha/bf16 speedups and what was measured."""
    results: dict = {"arms": arms}
    if "bf16" in arms:  # every arm against bf16, batch by batch
        base = {r["batch"]: r["tokens_per_s"] for r in arms["bf16"]["rows"]}
        results["speedup_over_bf16"] = {a: {str(r["batch"]): r["tokens_per_s"] / base[r["batch"]] for r in v["rows"]
                                            if r["batch"] in base} for a, v in arms.items() if a != "bf16"}
    if "bf16" in arms and any("prefill" in v for v in arms.values()):  # prompt time against bf16's
        base = {r["prompt_tokens"]: r["ms"] for r in arms["bf16"].get("prefill", [])}
        results["prefill_time_over_bf16"] = {a: {str(r["prompt_tokens"]): r["ms"] / base[r["prompt_tokens"]]
                                                 for r in v.get("prefill", []) if r["prompt_tokens"] in base}
                                             for a, v in arms.items() if a != "bf16"}
    if {"bf16", "escha"} <= set(arms):
        sp = {}
        for rb, re in zip(arms["bf16"]["rows"], arms["escha"]["rows"]):
            sp[str(rb["batch"])] = re["tokens_per_s"] / rb["tokens_per_s"]
        results["speedup_escha_over_bf16"] = sp
        if "1" in sp:
            results["target_batch1"] = {"required": 1.3, "measured": sp["1"], "met": sp["1"] >= 1.3}
    results.update({
        "benchmark": "e2e decode", "model": "Qwen3-14B-shaped (random weights)" if not args.tiny else "tiny Qwen3 (smoke test)",
        # The arguments the config was built from: transformers versions differ in which of them
        # stay attributes (5.x folds rope_theta into rope_parameters).
        "config": shape,
        "layers": config.num_hidden_layers, "bits": args.bits,
        "weights": "random: bf16 from transformers' init; Escha trellis bits, signs and scales from "
                   "escha.format.random_qweight; embeddings, norms and lm_head bf16 in both arms",
        "machine": machine(device),
    })
    return results


def write_results(results: dict, path: str) -> None:
    """Write the results document as JSON, creating the folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.graphs is None:
        args.graphs = "manual" if device.type == "cuda" else "none"
    if args.graphs != "none" and device.type != "cuda":
        ap.error("CUDA graphs need --device cuda")
    shape = model_shape(args)
    config = make_config(shape)
    batches = [int(b) for b in args.batches.split(",")]
    arms: dict = {}
    for arm in args.arms.split(","):
        model = build(config, arm, device, args.bits)
        mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        rows = []
        profiles = []
        for b in batches:
            rows.append(measure(model, b, args, device))
            print(f"{arm:6s} batch {b}: {rows[-1]['tokens_per_s']:.1f} tok/s "
                  f"({rows[-1]['ms_per_step']:.2f} ms/step, graphs={rows[-1]['graphs']})", flush=True)
            if args.profile:
                profiles.append(launch_profile(model, b, args, device))
                print(f"{arm:6s} batch {b}: {profiles[-1]['kernel_launches']} kernel launches a step, "
                      f"{profiles[-1]['escha_matmul_calls']} escha.matmul calls, "
                      f"{profiles[-1]['host_syncs']['count']} host synchronizations", flush=True)
        arms[arm] = {"rows": rows, "weights_bytes_on_device": mem}
        for tokens in [int(t) for t in args.prefill.split(",") if t]:
            arms[arm].setdefault("prefill", []).append(prefill_times(model, tokens, args, device))
            print(f"{arm:6s} prompt {tokens}: {arms[arm]['prefill'][-1]['ms']:.2f} ms", flush=True)
        for tokens in [int(t) for t in args.profile_prefill.split(",") if t]:
            p = prefill_profile(model, tokens, device)
            arms[arm].setdefault("prefill_profile", []).append(p)
            print(f"{arm:6s} prompt {tokens} profiled: {p['wall_ms_under_profiler']:.1f} ms wall, "
                  f"{p['gpu_kernel_us'] / 1e3:.1f} ms of GPU kernels", flush=True)
        if profiles:
            arms[arm]["launch_profile"] = profiles
        del model
        free_memory(device)
    results = summarize(arms, args, shape, config, device)
    if "speedup_escha_over_bf16" in results:
        print("speedup escha/bf16:", {k: round(v, 3) for k, v in results["speedup_escha_over_bf16"].items()})
    if args.out:
        write_results(results, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
