"""One decoder layer's input side on the H200: q/k/v (and gate/up) one Linear at a time, as one
product, and as one product with the RMSNorm before it folded in, against bf16 cuBLAS.

    python benchmarks/bench_shared.py --out DIR [--rounds 5] [--ms 1,8,16,64]

Arms, per projection set and M (bf16 activations; each arm starts from the residual stream x,
so every arm includes the layer's RMSNorm one way or another):
  bf16        transformers' RMSNorm, then torch.matmul per projection (cuBLAS)
  separate    the RMSNorm, then one escha.matmul per projection (each its own input transform)
  shared      the RMSNorm, then one escha.matmul over the stacked projections (escha.nn.share_inputs)
  folded      one escha.matmul over the stacked projections with the RMSNorm in its input
              transform (escha.nn.fold_norms); for q/k/v also Qwen3's q/k head norms in its output
              transform (the other arms apply them as transformers does)
Gate before timing: every escha arm against fp64 of the same function within the decode tolerance.
Timing: escha.bench's method (weights rotated over >= 4x L2, one CUDA graph per arm calling it
once per weight set, device events, rounds interleaved, median).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from escha.bench.cuda_timing import GraphTimer
from escha.bench.method import Spread, rotation_buffers, round_order
from escha.bench.report import git_sha
from escha.format import dequantize, random_qweight
from escha.format.shard import row_offsets, split_rows
from escha.norm import HEAD, HeadNorm, RowNorm
from escha.ops import matmul

# Qwen3-14B (TP=1): q/k/v 5120 + 1024 + 1024 rows and gate/up 2 x 17408 rows over 5120 inputs, with
# q/k head norms on the attention side; Llama-3-8B: q/k/v 4096 + 1024 + 1024 over 4096.
SETS = {"qkv_14b": ((5120, 1024, 1024), 5120, True), "gate_up_14b": ((17408, 17408), 5120, False),
        "qkv_8b": ((4096, 1024, 1024), 4096, False)}
EPS = 1e-6
TOL = 2 * (2.0**-8 + 2.0**-10)  # bf16 output, fp16 operands (docs/KERNELS.md tolerance table)


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen3RMSNorm (RowNorm.apply computes it, bit for bit)."""
    return RowNorm(w, EPS).apply(x)


def heads(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A per-head RMSNorm over 128-wide heads (Qwen3's q_norm), as transformers applies it."""
    return rms(y.unflatten(-1, (-1, HEAD)), w).flatten(-2)


class WeightSet:
    """One layer's stacked weight (random, as escha quantize's shared quantization gives it), its
    parts, and the norms' weights."""

    def __init__(self, rows: tuple[int, ...], k: int, head_norms: bool, seed: int, device: str = "cuda") -> None:
        self.rows = rows
        self.stacked = random_qweight(row_offsets(rows)[-1] + rows[-1], k, 2, seed=seed, device=device)
        self.parts = [p.clone() for p in split_rows(self.stacked, list(rows))]
        g = torch.Generator(device=device).manual_seed(seed)
        self.norm_w = (torch.rand(k, device=device, generator=g) + 0.5).to(torch.bfloat16)
        self.head_ws = ([(torch.rand(HEAD, device=device, generator=g) + 0.5).to(torch.bfloat16) for _ in rows[:2]]
                        if head_norms else [])
        self.dense = [dequantize(p).to(torch.bfloat16) for p in self.parts]
        self.row_norm = RowNorm(self.norm_w, EPS)
        self.head_norm = None
        if head_norms:  # q and k flagged, v not
            np_ = self.stacked.padded_shape[0]
            w = torch.zeros(np_, dtype=torch.bfloat16, device=device)
            flags = torch.zeros(np_ // HEAD, dtype=torch.int8, device=device)
            for off, n, hw in zip(row_offsets(rows), rows, self.head_ws):
                w[off:off + n] = hw.repeat(n // HEAD)
                flags[off // HEAD:(off + n) // HEAD] = 1
            self.head_norm = HeadNorm(w, flags, EPS)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return [y[..., o:o + n] for o, n in zip(row_offsets(self.rows), self.rows)]

    def finish(self, ys: list[torch.Tensor]) -> list[torch.Tensor]:
        """The head norms as the model applies them after the projections (q, k)."""
        return [heads(y, w) for y, w in zip(ys, self.head_ws)] + ys[len(self.head_ws):]

    # -- the arms: x (the residual stream) -> the projections' outputs, as the layer uses them
    def bf16(self, x):
        h = rms(x, self.norm_w)
        return self.finish([h @ d.T for d in self.dense])

    def separate(self, x):
        h = rms(x, self.norm_w)
        return self.finish([matmul(h, p) for p in self.parts])

    def shared(self, x):
        return self.finish(self.split(matmul(rms(x, self.norm_w), self.stacked)))

    def folded(self, x):
        return self.split(matmul(x, self.stacked, norm=self.row_norm, head_norm=self.head_norm))

    def exact(self, x):
        """fp64 of the layer's function with the exact weights (norms as the model computes them)."""
        h = rms(x, self.norm_w).double()
        ys = [(h @ dequantize(p).double().T).to(torch.bfloat16) for p in self.parts]
        return [y.double() for y in self.finish(ys)]


ARMS = ("bf16", "separate", "shared", "folded")


def gate(ws: WeightSet, x: torch.Tensor) -> dict[str, float]:
    """Each escha arm's worst relative error over its outputs against fp64 of the same function."""
    ref = ws.exact(x)
    return {arm: max(float((g.double() - r).norm() / r.norm()) for g, r in zip(getattr(ws, arm)(x), ref))
            for arm in ARMS[1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="1,8,16,64")
    ap.add_argument("--sets", default=",".join(SETS))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows_out, lines = [], []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    timer = GraphTimer(replays=10)
    for name in args.sets.split(","):
        rows, k, head_norms = SETS[name]
        n_total = sum(rows)
        sets = [WeightSet(rows, k, head_norms, seed=i) for i in range(max(2, rotation_buffers(l2, n_total * k * 2)))]
        for m in [int(v) for v in args.ms.split(",")]:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3 for _ in sets]
            gates = gate(sets[0], xs[0])
            log(f"{name} M={m} gates: " + ", ".join(f"{a} {e:.2e}" for a, e in gates.items()))
            if any(not e <= TOL for e in gates.values()):
                log(f"{name} M={m}: an arm failed its gate (tolerance {TOL:.1e}); not timed")
                continue
            samplers = {arm: timer.build(lambda i, arm=arm: getattr(sets[i], arm)(xs[i]), len(sets), arm)
                        for arm in ARMS}
            samples = {arm: [] for arm in ARMS}
            for r in range(args.rounds):
                for i in round_order(len(ARMS), r):
                    samples[ARMS[i]].append(samplers[ARMS[i]].sample())
            spread = {arm: Spread.of(s) for arm, s in samples.items()}
            base = spread["bf16"].median
            log(f"{name} M={m}: " + ", ".join(f"{a} {s.median:.1f} us ({s.median / base:.2f}x bf16)"
                                              for a, s in spread.items()))
            rows_out.append({"set": name, "M": m, "rel_err": gates,
                             **{arm: {"us": s.median, "us_min": s.low, "us_max": s.high, "samples": samples[arm]}
                                for arm, s in spread.items()}})
            del samplers
        del sets
        torch.cuda.empty_cache()
    doc = {"benchmark": "shared inputs and folded norms, one layer's input side",
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "git_sha": git_sha(),
           "sets": {k: {"rows": v[0], "in": v[1], "head_norms": v[2]} for k, v in SETS.items()}, "rows": rows_out}
    with open(os.path.join(args.out, "shared_h200.json"), "w") as f:
        json.dump(doc, f, indent=1)
    with open(os.path.join(args.out, "shared_h200.log"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
