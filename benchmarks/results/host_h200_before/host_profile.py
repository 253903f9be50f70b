# One-off profile of an eager call's host time (run at commit 23a86d4; benchmarks/bench_host.py replaced it).
"""Where an eager escha.matmul call's host time goes (cProfile), one-off."""
import cProfile, pstats, io, time, sys
import torch
import escha
from escha.format import random_qweight
from escha.kernels.decode_wgmma import decode_wgmma, packed_words

qw = random_qweight(17408, 5120, bits=2, seed=0, device="cuda")
packed_words(qw)
for m in (1, 512):
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    fns = {"matmul": lambda: escha.matmul(x, qw)}
    if m == 1:
        fns["decode_wgmma"] = lambda: decode_wgmma(x, qw)
    for name, fn in fns.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"M={m} {name}: host {1e6*(t1-t0)/n:.1f} us/call, with sync {1e6*(t2-t0)/n:.1f} us/call", flush=True)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
        print(s.getvalue()[:9000])
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45)
        print(s.getvalue()[:9000])
