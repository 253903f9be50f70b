"""Where the loader candidate's output differs from the rule kernel's (GPU, patched tree): the GEMM's
partials alone (no dependent launches, a synchronize between kernels), repeated, so that a
difference is placed in the GEMM or the launch chain, and told apart as a race (runs disagree
with each other) or a deterministic fault (wrong (segment, row, token) blocks every time)."""
import dataclasses
import importlib

import torch

from escha.format import random_qweight
from escha.kernels.transforms import hadamard_input

dw = importlib.import_module("escha.kernels.decode_wgmma")


def valid(ws, counts):
    """Mask of the partials the GEMM writes: segment s of 64-row group r for s < counts[r]."""
    segs, m, np_ = ws.shape
    seg = torch.arange(segs, device=ws.device)[:, None, None]
    return (seg < counts.repeat_interleave(64)[None, None, :np_]).expand(segs, m, np_)


for bits, m in ((2, 16), (2, 64), (3, 64), (2, 8)):
    qw = random_qweight(300, 700, bits=bits, seed=m + 100 * bits, device="cuda")
    x = torch.randn(m, 700, device="cuda", dtype=torch.bfloat16)
    cfg = dw.decode_wgmma_config(qw, m)
    for pdl in (False, True):
        base = dataclasses.replace(cfg, dependent_launch=pdl, early_start=pdl)
        xq, _ = hadamard_input(x, qw, mma_order=True, halves=cfg.halves)
        torch.cuda.synchronize()
        want, counts = dw.gemm_partials(xq, qw, base)
        torch.cuda.synchronize()
        mask = valid(want, counts)
        runs = []
        for _ in range(4):
            got, _ = dw.gemm_partials(xq, qw, dataclasses.replace(base, loader=True))
            torch.cuda.synchronize()
            runs.append(got)
        for r, got in enumerate(runs):
            d = (got != want) & mask
            where = d.nonzero()
            print(f"K={bits} M={m} pdl={pdl} {cfg} run {r}: partials differ at {int(d.sum())} of {int(mask.sum())}"
                  f" (segments {sorted(set(where[:, 0].tolist()))[:8]}, tokens {sorted(set(where[:, 1].tolist()))[:16]},"
                  f" 64-row groups {sorted(set((where[:, 2] // 64).tolist()))[:8]}); max |diff|"
                  f" {float((got - want).abs()[d].max()) if d.any() else 0.0:.3g}; vs run 0:"
                  f" {int(((got != runs[0]) & mask).sum())}")
        y0 = dw.decode_wgmma(x, qw, config=base)
        y1 = dw.decode_wgmma(x, qw, config=dataclasses.replace(base, loader=True))
        torch.cuda.synchronize()
        print(f"  whole call pdl={pdl}: {int((y0 != y1).sum())} of {y0.numel()} outputs differ")
