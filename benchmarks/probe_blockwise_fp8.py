"""Does cuBLAS's block-scaled fp8 GEMM run on this GPU, and at what cost against the row-wise one?

The dequantize-once path needs a per-token activation scale today, so its activation pass reads x
twice (pass 1: per-block maxima; pass 2: transform again and quantize). With a scale per token
and 128-column block (BlockWise1x128) the pass would be one read of x, and the weight scratch
could carry a scale per row and 128-column block as well (finer than today's per row). This
probe times torch._scaled_mm on random e4m3 operands with

* row-wise scales (today's path): scale_a [M, 1], scale_b [1, N];
* BlockWise1x128 x BlockWise128x128: scale_a [M, K/128], scale_b [K/128, N/128];
* BlockWise1x128 x BlockWise1x128:   scale_a [M, K/128], scale_b [K/128, N];

each scale laid out contiguous and transposed (the layout cuBLAS wants is not in torch's docs),
and checks every variant that runs against an fp32 product of the dequantized operands. Same
method as bench_prefill.py: CUDA graphs rotating over weight buffers past the L2, interleaved
rounds (Williams order), median of the rounds.

    python benchmarks/probe_blockwise_fp8.py --out benchmarks/results/probe_blockwise_fp8_h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from escha.bench.cuda_timing import GraphTimer  # noqa: E402
from escha.bench.method import Spread, rotation_buffers, round_order  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704)}


def layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scale tensor contiguous, and the same values with the other dimension contiguous."""
    return {"c": t.contiguous(), "t": t.t().contiguous().t()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="512,2048,8192")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    result = {"device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "git": git_sha(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "rows": [], "errors": {}}
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        kb = k // 128
        nb = rotation_buffers(props.L2_cache_size, n * k)
        ws = [(torch.randn(n, k, device=dev) / 4).to(torch.float8_e4m3fn) for _ in range(nb)]
        sb_row = torch.rand(1, n, device=dev) + 0.5
        sb_blk = torch.rand(kb, (n + 127) // 128, device=dev) + 0.5
        sb_1x = torch.rand(kb, n, device=dev) + 0.5
        for m in [int(v) for v in args.ms.split(",")]:
            a = (torch.randn(m, k, device=dev) / 4).to(torch.float8_e4m3fn)
            sa_row = torch.rand(m, 1, device=dev) + 0.5
            sa_1x = torch.rand(m, kb, device=dev) + 0.5
            arms = {"rowwise": (sa_row, sb_row)}
            for la, sa in layouts(sa_1x).items():
                for lb, sb in layouts(sb_blk).items():
                    arms[f"1x128-{la}/128x128-{lb}"] = (sa, sb)
                for lb, sb in layouts(sb_1x).items():
                    arms[f"1x128-{la}/1x128-{lb}"] = (sa, sb)
            runnable = {}
            for name, (sa, sb) in arms.items():
                try:
                    y = torch._scaled_mm(a, ws[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 (recorded: which recipes this build runs)
                    result["errors"][f"{shape}/M={m}/{name}"] = f"{type(e).__name__}: {e}"[:300]
                    continue
                # Reference: dequantized operands in fp32 (block scales expanded over their blocks).
                af = a.float() * (sa.repeat_interleave(128, 1)[:, :k] if sa.shape[1] > 1 else sa)
                if sb.shape == (1, n):
                    wf = ws[0].float() * sb.t()
                elif sb.shape == (kb, n):
                    wf = ws[0].float() * sb.t().repeat_interleave(128, 1)[:, :k]
                else:
                    wf = ws[0].float() * sb.t().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
                ref = af @ wf.t()
                err = float((y.float() - ref).norm() / ref.norm())
                result["errors"][f"{shape}/M={m}/{name}/rel_err"] = err
                if err < 1e-2:
                    runnable[name] = (lambda sa_, sb_: lambda i: torch._scaled_mm(
                        a, ws[i % nb].t(), scale_a=sa_, scale_b=sb_, out_dtype=torch.bfloat16))(sa, sb)
            samplers = {name: GraphTimer().build(fn, max(nb, 6), name) for name, fn in runnable.items()}
            names = list(samplers)
            samples = {name: [] for name in names}
            for r in range(args.rounds):
                for i in round_order(len(names), r):
                    samples[names[i]].append(samplers[names[i]].sample())
            base = Spread.of(samples["rowwise"]).median if "rowwise" in samples else float("nan")
            for name in names:
                s = Spread.of(samples[name])
                result["rows"].append({"shape": shape, "m": m, "arm": name, "us": s.median, "low": s.low,
                                       "high": s.high, "samples": samples[name]})
                print(f"{shape:8s} M={m:5d} {name:24s} {s.median:8.1f} us  x{s.median / base:.3f} of rowwise",
                      flush=True)
            del samplers
        del ws
        torch.cuda.empty_cache()
    for key, e in result["errors"].items():
        print("  ", key, e, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
