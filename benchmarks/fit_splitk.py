"""Measure the best split-K on the GPU and fit the split rule, for either decode kernel.

    python benchmarks/fit_splitk.py --out DIR [--rounds 3] [--kernel decode|decode-wgmma]

decode (the portable kernel): gate_up-like N in {34816, 17408, 8704} x K=5120 and down-like N=5120
x K in {17408, 8704, 4352}, each at M in {8, 40, 64} (18 points); splits 1, 2, 4, 8 with the default
decode configuration otherwise. Fit: over (min_ktiles, max_programs), the rule of
escha.kernels.splitk that gets the most points exactly, ties broken by the smallest worst-case
loss. Writes splitk_h200.json.

decode-wgmma (the register-operand kernel): Qwen3-14B's four projection sets at tensor-parallel
degrees 1, 2 and 4 (12 shapes), each at M in {1, 16, 64} (36 points); splits 1, 2, 3, 4, 6, 8 with
the rule's configuration otherwise (``decode_wgmma.config_with_split``, which also gives each grid
the start the rule would). Timing: escha.bench's method. Fit, per token block class (8-16, 32-64,
128-256 tokens): split = the one nearest to T / (programs of one k-slice), clamped to 2..8 (one
slice was the slowest split at all 36 points of the first sweep, splitk_wgmma_h200.json) and to
two k-blocks a slice, with the T of least worst-case loss; compared with the rule in force.
Writes splitk_wgmma_h200.json. ``--refit FILE`` fits a written table again, with no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import env_info, graph_of, interleaved, weight_set  # noqa: E402

from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.bench.method import Spread, rotation_buffers, round_order  # noqa: E402
from escha.format import QuantizedWeight, random_qweight  # noqa: E402
from escha.kernels import SplitKRule, decode, decode_config, decode_split_k  # noqa: E402
from escha.kernels.decode_wgmma import (BLOCK_K, FRAGMENT_ROWS, config_with_split, decode_wgmma,  # noqa: E402
                                        decode_wgmma_config)

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
WGMMA_MS = (1, 16, 64)
WGMMA_SPLITS = (1, 2, 3, 4, 6, 8)
TOKEN_CLASSES = ((8, 16), (32, 64), (128, 256))


def wgmma_split_for(row_programs: int, kblocks: int, target: float) -> int:
    """The split nearest to ``target`` programs over ``row_programs`` programs of one k-slice,
    clamped to 2..8 and to at least two k-blocks a slice."""
    s = max(2, min(8, round(target / row_programs)))
    return max(1, min(s, kblocks // 2))


def fit_wgmma(table: list[dict]) -> dict:
    """Per token class, the target of least worst-case loss (ties: mean loss) over the measured splits."""
    out = {}
    for lo, hi in TOKEN_CLASSES:
        pts = [p for p in table if lo <= p["block_tokens"] <= hi]
        if not pts:
            continue
        best = None
        for target in range(33, 132 * 16 + 1, 33):
            losses = []
            for p in pts:
                s = wgmma_split_for(p["row_programs"], p["kblocks"], target)
                losses.append(nearest_loss(p, s))
            key = (max(losses), sum(losses) / len(losses))
            if best is None or key < best[0]:
                best = (key, target)
        (worst, mean), target = best
        swept = [p["us"][str(p["rule"])] / min(p["us"].values()) - 1 for p in pts]
        now = [nearest_loss(p, rule_split(p)) for p in pts]
        out[f"{lo}-{hi}"] = {"target_programs": target, "worst_loss": worst, "mean_loss": mean,
                             "rule_in_force_worst_loss": max(swept), "rule_now_worst_loss": max(now),
                             "rule_now_mean_loss": sum(now) / len(now), "points": len(pts)}
    return out


def nearest_loss(p: dict, split: int) -> float:
    """A point's loss at ``split`` (the nearest measured split) against its best split."""
    s = min(p["us"], key=lambda k: abs(int(k) - split))
    return p["us"][s] / min(p["us"].values()) - 1


def rule_split(p: dict) -> int:
    """The split that escha's rule gives a table point now (132 SMs, as the H200)."""
    qw = QuantizedWeight.placeholder((p["N"], p["K"]), 2, device="meta")
    return decode_wgmma_config(qw, p["M"], torch.device("cuda")).split


def sweep_wgmma(args) -> None:
    info = env_info()
    cuda = torch.device("cuda")
    timer = GraphTimer(replays=10)
    table = []
    for n, k in WGMMA_POINTS:
        count = max(2, rotation_buffers(info["l2_bytes"], n * k / 2))  # the repacked words: 4 bits a weight
        qws = [random_qweight(n, k, 2, seed=100 + i, device="cuda") for i in range(count)]
        for m in WGMMA_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            rule = decode_wgmma_config(qws[0], m, cuda)
            kblocks = qws[0].padded_shape[1] // BLOCK_K
            splits = sorted({s for s in WGMMA_SPLITS if s <= kblocks} | {rule.split})
            cfgs = {str(s): config_with_split(qws[0], m, s, cuda) for s in splits}
            samplers = {s: timer.build(lambda i, c=c: decode_wgmma(x, qws[i], config=c), len(qws), s)
                        for s, c in cfgs.items()}
            names = list(samplers)
            samples = {s: [] for s in names}
            for r in range(args.rounds):
                for i in round_order(len(names), r):
                    samples[names[i]].append(samplers[names[i]].sample())
            us = {s: Spread.of(v).median for s, v in samples.items()}
            row_programs = qws[0].padded_shape[0] // (FRAGMENT_ROWS * rule.fragments) * -(-m // rule.block_tokens)
            p = {"N": n, "K": k, "M": m, "block_tokens": rule.block_tokens, "row_programs": row_programs,
                 "kblocks": kblocks, "us": us, "best": int(min(us, key=us.get)), "rule": rule.split}
            table.append(p)
            print(f"N={n:6d} K={k:6d} M={m:3d} rule={rule.split} best={p['best']} "
                  + " ".join(f"s{s}={v:.1f}" for s, v in us.items()), flush=True)
            del samplers
        del qws
        torch.cuda.empty_cache()
    res = fit_wgmma(table)
    with open(f"{args.out}/splitk_wgmma_h200.json", "w") as f:
        json.dump({"env": info, "table": table, "fit": res}, f, indent=1)
    report_wgmma(res)


def report_wgmma(res: dict) -> None:
    for cls, r in res.items():
        print(f"tokens {cls}: split ~ {r['target_programs']} / programs of one slice: worst loss "
              f"{100 * r['worst_loss']:.1f}% (rule swept {100 * r['rule_in_force_worst_loss']:.1f}%, "
              f"rule now {100 * r['rule_now_worst_loss']:.1f}% worst, {100 * r['rule_now_mean_loss']:.1f}% mean), "
              f"{r['points']} points")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel", choices=("decode", "decode-wgmma"), default="decode")
    ap.add_argument("--refit", metavar="JSON", help="fit a written decode-wgmma table again (no GPU)")
    args = ap.parse_args()
    if args.refit:
        with open(args.refit) as f:
            doc = json.load(f)
        doc["fit"] = fit_wgmma(doc["table"])
        with open(f"{args.out}/{os.path.basename(args.refit)}", "w") as f:
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
