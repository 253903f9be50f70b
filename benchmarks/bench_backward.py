"""Peak memory and time of escha.matmul's backward product grad_x = grad_y @ W_hat in three forms:
the whole W_hat by the reference decoder at once ("w_hat", the first form), W_hat by runs of 128-row
blocks ("w_hat_runs", eb5ce3e) and the transform domain with the core T by runs ("core_runs", what
the backward does: ((g diag(g c su)) Hn) T Hk diag(sv) / 128).

    python benchmarks/bench_backward.py --out DIR [--shape 4096x4096] [--m 8] [--run-weights N,...]

Each arm runs in a fresh process, so its peak resident memory (CPU) or peak allocated memory (CUDA,
``torch.cuda.max_memory_allocated``, after a first call that compiles the kernels) is its own;
seconds are the median of three calls; the weight's tensors, g and the result are in every arm's.
All arms must give the same product within fp32's summation-order error, or nothing is written.
``--run-weights`` adds the transform-domain form at other run sizes (arms "core_runs_N", N padded
weights a run).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

import torch


def arm(name: str, shape: tuple[int, int], m: int, device: str, run_weights: int) -> dict:
    """One arm in this process: its product, peak memory above the inputs, and seconds."""
    from escha.format import dequantize, random_qweight
    from escha.format.qweight import TENSOR_NAMES, QuantizedWeight
    from escha.ops import _row_runs, _times_w
    qw = random_qweight(*shape, 2, seed=0).to(device)
    g = torch.randn(m, shape[0], generator=torch.Generator().manual_seed(1)).to(device)

    def w_hat_runs() -> torch.Tensor:
        acc = g.new_zeros((m, shape[1]))
        for r0, _, args in _row_runs(qw, run_weights):
            w = dequantize(QuantizedWeight.trusted(args[:len(TENSOR_NAMES)], (args[-4], shape[1]), 2, 0))
            acc.addmm_(g[:, r0:r0 + w.shape[0]], w)
        return acc

    run = {"w_hat": lambda: g @ dequantize(qw), "w_hat_runs": w_hat_runs,
           "core_runs": lambda: _times_w(g, qw, run_weights)}[name.split("@")[0]]
    if device == "cuda":  # a first call compiles the kernels; the peak and times are of the calls after it
        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # the process's peak resident memory: its first call's
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        y = run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = sorted(times)[1]
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"arm": name, "run_weights": None if name == "w_hat" else run_weights,
            "peak_bytes_above_inputs": int(peak - base), "seconds": round(seconds, 4), "y": y.cpu()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--run-weights", default="", help="more run sizes for the transform-domain form (comma-separated)")
    ap.add_argument("--arm", help=argparse.SUPPRESS)  # a child process's one arm
    a = ap.parse_args()
    shape = tuple(int(v) for v in a.shape.split("x"))
    if a.arm:
        name, _, n = a.arm.partition("@")
        from escha.ops import BACKWARD_RUN_WEIGHTS
        r = arm(name, shape, a.m, a.device, int(n) if n else BACKWARD_RUN_WEIGHTS[a.device])
        r["arm"] = name if not n else f"{name}_{n}"
        torch.save(r, os.path.join(a.out, f"{a.arm}.pt"))
        return
    os.makedirs(a.out, exist_ok=True)
    rows = []
    names = ["w_hat", "w_hat_runs", "core_runs"] + [f"core_runs@{int(n)}" for n in a.run_weights.split(",") if n]
    for name in names:
        subprocess.run([sys.executable, __file__, "--out", a.out, "--shape", a.shape, "--m", str(a.m),
                        "--device", a.device, "--arm", name], check=True)
        rows.append(torch.load(os.path.join(a.out, f"{name}.pt")))
        os.remove(os.path.join(a.out, f"{name}.pt"))
    want = rows[0]["y"]
    for r in rows:
        torch.testing.assert_close(r.pop("y"), want, rtol=1e-5, atol=1e-4)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else platform.processor() or platform.machine(),
           "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
           "git": os.environ.get("ESCHA_GIT_SHA", git),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    result = {"env": env, "shape": list(shape), "m": a.m, "arms": rows,
              "w_hat_fp32_bytes": shape[0] * shape[1] * 4}
    with open(os.path.join(a.out, f"backward_{a.device}.json"), "w") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        print(f"{r['arm']:20s} peak {r['peak_bytes_above_inputs'] / 2**20:8.1f} MiB  {r['seconds'] * 1e3:9.2f} ms")


if __name__ == "__main__":
    main()
