"""Measure the best split-K on the GPU and fit the split rule, for either decode kernel.

    python benchmarks/fit_splitk.py --out DIR [--rounds 3] [--kernel decode|decode-wgmma]

decode (the portable kernel): gate_up-like N in {34816, 17408, 8704} x K=5120 and down-like N=5120
x K in {17408, 8704, 4352}, each at M in {8, 40, 64} (18 points); splits 1, 2, 4, 8 with the default
decode configuration otherwise. Fit: over (min_ktiles, max_programs), the rule of
escha.kernels.splitk that gets the most points exactly, ties broken by the smallest worst-case
loss. Writes splitk_h200.json.

decode-wgmma (the register-operand kernel): Qwen3-14B's four projection sets at tensor-parallel
degrees 1, 2 and 4 (12 shapes; ``--family llama3-8b`` adds Llama-3-8B's at 2 and 4, the narrow
shards; ``--family tp8`` takes both models' at 8 alone), each at M in ``--ms`` (default 1, 16,
64, 128); grids of 0.5 to 3 waves (a wave: the programs the SMs hold of the variant,
``decode_wgmma.PROGRAMS_PER_SM``), the whole-tile k-splits of 3 and 6 slices, and "fill" (one
wave or, if the weight has fewer steps, one step a program: no floor of k-blocks a program),
with the rule's configuration otherwise (``decode_wgmma.config_with_programs``, which starts the
GEMM as the rule would start that grid); "rule_late" and "fill_late" (or "_early") are those two
grids with the other start. Every arm is gated against fp64 first (``bench_decode_wgmma.gate_gemm``).
Timing: escha.bench's method. Reported per token block class (8-16, 32-64, 128-256 tokens): the
rule's (one wave) loss against the best grid, and which grids were best. Writes
splitk_wgmma_h200.json. ``--refit FILE`` reports a written table again, with no GPU; FILE is the
JSON or the sweep's printed log (one line a point).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import env_info, graph_of, interleaved, weight_set  # noqa: E402
from bench_decode_wgmma import TOL, gate_gemm  # noqa: E402

from escha import dequantize  # noqa: E402
from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.bench.method import Spread, rotation_buffers, round_order  # noqa: E402
from escha.format import QuantizedWeight, random_qweight  # noqa: E402
from escha.kernels import SplitKRule, decode, decode_config, decode_split_k  # noqa: E402
from escha.kernels.decode_wgmma import (PROGRAMS_PER_SM, config_with_programs, decode_wgmma,  # noqa: E402
                                        decode_wgmma_config, rule_variant, tiles_and_steps)

POINTS = [(34816, 5120), (17408, 5120), (8704, 5120), (5120, 17408), (5120, 8704), (5120, 4352)]
MS = (8, 40, 64)
SPLITS = (1, 2, 4, 8)


def fit(table: list[dict]) -> dict:
    best = None
    for t in range(4, 161, 2):
        for c in range(132, 132 * 24 + 1, 66):
            rule = SplitKRule(min_ktiles=t, max_programs=c)
            exact, worst = 0, 0.0
            for p in table:
                s = decode_split_k(p["nblk"], p["ktiles"], rule)
                loss = p["us"][str(s)] / min(p["us"].values()) - 1
                exact += loss == 0.0
                worst = max(worst, loss)
            key = (exact, -worst)
            if best is None or key > best[0]:
                best = (key, t, c, exact, worst)
    _, t, c, exact, worst = best
    return {"min_ktiles": t, "max_programs": c, "exact": exact, "points": len(table), "worst_loss": worst}


# Qwen3-14B's projections at TP = 1, 2, 4: [q | k | v] and [gate | up] split by rows, o and down by columns.
WGMMA_POINTS = [shape for t in (1, 2, 4) for shape in
                ((7168 // t, 5120), (5120, 5120 // t), (34816 // t, 5120), (5120, 17408 // t))]
# Llama-3-8B's at TP = 2, 4 (q/k/v 6144 x 4096, o 4096 x 4096, gate/up 28672 x 4096, down 4096 x 14336).
LLAMA3_8B_POINTS = [shape for t in (2, 4) for shape in
                    ((6144 // t, 4096), (4096, 4096 // t), (28672 // t, 4096), (4096, 14336 // t))]
# Both at TP = 8 (their 8 KV heads allow it): narrower than any shard the rule was fitted on.
TP8_POINTS = [(7168 // 8, 5120), (5120, 5120 // 8), (34816 // 8, 5120), (5120, 17408 // 8),
              (6144 // 8, 4096), (4096, 4096 // 8), (28672 // 8, 4096), (4096, 14336 // 8)]
FAMILIES = {"qwen3-14b": WGMMA_POINTS, "llama3-8b": WGMMA_POINTS + LLAMA3_8B_POINTS, "tp8": TP8_POINTS}
WGMMA_MS = (1, 16, 64, 128)
WAVES = (0.5, 1, 1.5, 2, 3)  # grids swept: these multiples of one wave (the programs the SMs hold)
TOKEN_CLASSES = ((8, 16), (32, 64), (128, 256))


def wgmma_grids(qw: QuantizedWeight, m: int, sms: int) -> dict[str, int]:
    """The program counts swept at a point: multiples of one wave ("w1" is the rule's choice
    wherever no other bound applies), the k-split of whole row tiles in 3 and 6 slices ("t3",
    "t6": the grids of the kernel before the even split), each within 1..steps, and "fill" (the
    wave, or one program a step, without the rule's floor of k-blocks a program) where the rule's
    grid is another."""
    rule = decode_wgmma_config(qw, m, torch.device("cuda"))
    tiles, steps = tiles_and_steps(qw.padded_shape, rule.fragments)
    wave = PROGRAMS_PER_SM[(qw.bits, rule.block_tokens)] * sms // -(-m // rule.block_tokens)
    grids = {f"w{w:g}": max(1, round(w * wave)) for w in WAVES}
    grids.update({"t3": 3 * tiles, "t6": 6 * tiles, "rule": rule.programs})
    grids = {k: v for k, v in grids.items() if v <= steps}
    if min(steps, wave) != rule.programs:  # the rule's floor of k-blocks a program left the wave short
        grids["fill"] = min(steps, wave)
    return grids


def wgmma_configs(qw: QuantizedWeight, m: int, grids: dict[str, int]) -> dict:
    """The configuration of each grid (the start the rule gives it), and the rule's and fill's
    grids with the other start ("<grid>_late" or "<grid>_early"), added to ``grids`` too."""
    cfgs = {g: config_with_programs(qw, m, v, torch.device("cuda")) for g, v in grids.items()}
    for g in ("rule", "fill"):
        if g in cfgs:
            other = f"{g}_{'late' if cfgs[g].early_start else 'early'}"
            cfgs[other] = replace(cfgs[g], early_start=not cfgs[g].early_start)
            grids[other] = grids[g]
    return cfgs


def fit_wgmma(table: list[dict]) -> dict:
    """The rule's loss against the best grid measured at each point, and how often each grid was
    the best, per token class."""
    out = {}
    for lo, hi in TOKEN_CLASSES:
        pts = [p for p in table if lo <= p["block_tokens"] <= hi]
        if not pts:
            continue
        loss = [p["us"]["rule"] / min(p["us"].values()) - 1 for p in pts]
        wins: dict[str, int] = {}
        for p in pts:
            best = min(p["us"], key=p["us"].get)
            wins[best] = wins.get(best, 0) + 1
        out[f"{lo}-{hi}"] = {"rule_worst_loss": max(loss), "rule_mean_loss": sum(loss) / len(loss),
                             "best_grid_counts": wins, "points": len(pts)}
    return out


def sweep_wgmma(args) -> None:
    info = env_info()
    timer = GraphTimer(replays=10)
    table = []
    for n, k in FAMILIES[args.family]:
        count = max(2, rotation_buffers(info["l2_bytes"], n * k / 2))  # the repacked words: 4 bits a weight
        qws = [random_qweight(n, k, 2, seed=100 + i, device="cuda") for i in range(count)]
        w_ref = dequantize(qws[0]).double()
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            grids = wgmma_grids(qws[0], m, info["sms"])
            cfgs = wgmma_configs(qws[0], m, grids)
            for g, c in cfgs.items():  # every arm gated first: fp64 reference, the decode tolerance
                err = gate_gemm(qws[0], w_ref, m, torch.bfloat16, cfg=c)
                if not err < TOL[torch.bfloat16]:
                    raise SystemExit(f"GATE FAILED: {g} rel err {err:.3e} for {n}x{k} M={m} {c}")
            samplers = {g: timer.build(lambda i, c=c, q=qws: decode_wgmma(x, q[i], config=c), len(qws), g)
                        for g, c in cfgs.items()}
            names = list(samplers)
            samples = {g: [] for g in names}
            for r in range(args.rounds):
                for i in round_order(len(names), r):
                    samples[names[i]].append(samplers[names[i]].sample())
            us = {g: Spread.of(v).median for g, v in samples.items()}
            rule = cfgs["rule"]
            p = {"N": n, "K": k, "M": m, "block_tokens": rule.block_tokens,
                 "steps": tiles_and_steps(qws[0].padded_shape, rule.fragments)[1],
                 "token_blocks": -(-m // rule.block_tokens), "sms": info["sms"], "programs": grids, "us": us,
                 "best": min(us, key=us.get)}
            table.append(p)
            print(f"N={n:6d} K={k:6d} M={m:3d} best={p['best']} "
                  + " ".join(f"{g}({grids[g]})={v:.1f}" for g, v in us.items()), flush=True)
            del samplers
        del qws, w_ref
        torch.cuda.empty_cache()
    res = fit_wgmma(table)
    with open(f"{args.out}/splitk_wgmma_h200.json", "w") as f:
        json.dump({"env": info, "table": table, "fit": res}, f, indent=1)
    report_wgmma(res)


def parse_wgmma_log(path: str) -> list[dict]:
    """The table from the sweep's printed lines ("N=... K=... M=... best=... grid(programs)=us ...")."""
    table = []
    with open(path) as f:
        for line in f:
            head = re.match(r"N=\s*(\d+) K=\s*(\d+) M=\s*(\d+) best=(\S+) (.*)", line)
            if not head:
                continue
            n, k, m = (int(head.group(i)) for i in (1, 2, 3))
            arms = re.findall(r"(\S+)\((\d+)\)=([\d.]+)", head.group(5))
            table.append({"N": n, "K": k, "M": m, "block_tokens": rule_variant(m, 2)[0],
                          "programs": {g: int(p) for g, p, _ in arms}, "us": {g: float(u) for g, _, u in arms},
                          "best": head.group(4)})
    return table


def report_wgmma(res: dict) -> None:
    for cls, r in res.items():
        print(f"tokens {cls}: the rule's loss against the best grid: worst {100 * r['rule_worst_loss']:.1f}%, "
              f"mean {100 * r['rule_mean_loss']:.1f}% over {r['points']} points; best grids {r['best_grid_counts']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", choices=("decode", "decode-wgmma"), default="decode")
    ap.add_argument("--refit", metavar="JSON", help="fit a written decode-wgmma table again (no GPU)")
    ap.add_argument("--ms", type=lambda v: [int(t) for t in v.split(",")], default=list(WGMMA_MS),
                    help="decode-wgmma: token counts, comma-separated")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="qwen3-14b",
                    help="decode-wgmma: llama3-8b adds Llama-3-8B's shards at TP 2 and 4; tp8: both models' "
                         "shards at TP 8 only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.refit:
        if args.refit.endswith(".json"):
            with open(args.refit) as f:
                doc = json.load(f)
        else:
            doc = {"env": {"source": os.path.basename(args.refit)}, "table": parse_wgmma_log(args.refit)}
        doc["fit"] = fit_wgmma(doc["table"])
        name = os.path.splitext(os.path.basename(args.refit))[0] + ".json"
        with open(f"{args.out}/{name}", "w") as f:
            json.dump(doc, f, indent=1)
        report_wgmma(doc["fit"])
        return
    if args.kernel == "decode-wgmma":
        sweep_wgmma(args)
        return
    info = env_info()
    table = []
    for n, k in POINTS:
        qws = weight_set(n, k, 4 * info["l2_bytes"], seed=n + k)
        for m in MS:
            x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
            base = decode_config(qws[0], m)
            arms = {}
            for s in SPLITS:
                cfg = replace(base, split=s, fuse_output=s == 1)
                arms[str(s)] = (graph_of(lambda q, c=cfg: decode(x, q, config=c), qws), len(qws))
            t = interleaved(arms, args.rounds)
            nblk, ktiles = n // base.block_n, k // 16
            best = min(t, key=t.get)
            table.append({"N": n, "K": k, "M": m, "nblk": nblk, "ktiles": ktiles, "us": t, "best": int(best)})
            print(f"N={n:6d} K={k:6d} M={m:2d} nblk={nblk:3d} ktiles={ktiles:5d} best={best} "
                  + " ".join(f"s{s}={v:.1f}" for s, v in t.items()), flush=True)
        del qws
        torch.cuda.empty_cache()
    res = fit(table)
    rule = SplitKRule(min_ktiles=res["min_ktiles"], max_programs=res["max_programs"])
    for p in table:
        p["rule"] = decode_split_k(p["nblk"], p["ktiles"], rule)
    with open(f"{args.out}/splitk_h200.json", "w") as f:
        json.dump({"env": info, "table": table, "fit": res}, f, indent=1)
    print(f"\nfit: split = largest power of two <= 8 with ktiles/split >= {res['min_ktiles']} and "
          f"nblk*split <= {res['max_programs']}: exact on {res['exact']}/{res['points']}, "
          f"worst loss {100 * res['worst_loss']:.1f}%")
    print("| N | K | M | best | rule | us at best | us at rule |")
    print("|---|---|---|---|---|---|---|")
    for p in table:
        print(f"| {p['N']} | {p['K']} | {p['M']} | {p['best']} | {p['rule']} | {p['us'][str(p['best'])]:.1f} "
              f"| {p['us'][str(p['rule'])]:.1f} |")


if __name__ == "__main__":
    main()
