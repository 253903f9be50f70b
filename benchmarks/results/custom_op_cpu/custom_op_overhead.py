"""Dispatch cost of a no-op operator registered two ways, on the CPU (one-off; docs/KERNELS.md,
"Host time of a call"): torch.library.custom_op (escha.matmul's registration) against a plain
torch.library.Library definition with a CompositeExplicitAutograd kernel.

    python benchmarks/results/custom_op_cpu/custom_op_overhead.py > custom_op_overhead.txt
"""
import datetime
import platform
import subprocess
import time

import torch


def impl(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: int, d: int, e: int) -> torch.Tensor:
    return torch.empty(0)


SCHEMA = "(Tensor x, Tensor a, Tensor b, int c, int d, int e) -> Tensor"
torch.library.custom_op("scratch::noop", impl, mutates_args=(), schema=SCHEMA)
lib = torch.library.Library("scratch2", "DEF")
lib.define("noop" + SCHEMA)
lib.impl("noop", lambda x, a, b, c, d, e: torch.empty(0), "CompositeExplicitAutograd")
x, a, b = torch.randn(4), torch.randn(4), torch.randn(4)


def us_per_call(f, n: int = 20000) -> float:
    for _ in range(100):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, "
      f"{torch.get_num_threads()} threads, git {sha}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")
print(f"direct call          {us_per_call(lambda: impl(x, a, b, 1, 2, 3)):6.2f} us")
print(f"custom_op            {us_per_call(lambda: torch.ops.scratch.noop(x, a, b, 1, 2, 3)):6.2f} us")
print(f"Library, CEA kernel  {us_per_call(lambda: torch.ops.scratch2.noop(x, a, b, 1, 2, 3)):6.2f} us")
with torch.inference_mode():
    print(f"custom_op, inference_mode  {us_per_call(lambda: torch.ops.scratch.noop(x, a, b, 1, 2, 3)):6.2f} us")
    print(f"Library, inference_mode    {us_per_call(lambda: torch.ops.scratch2.noop(x, a, b, 1, 2, 3)):6.2f} us")
