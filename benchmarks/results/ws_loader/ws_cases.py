"""The loader-partition candidate under compute-sanitizer (run.sh): every kernel launch of a few
decode calls with the copies in a loader warp, K 2 and 3, 1-64 tokens (ptxas fails on its
128-token build), caps 64 and, up to 32 tokens, 48; the rule's grid, one step a program and
one program; each output compared with the rule kernel's bits on the same grid."""
import dataclasses
import importlib

import torch

from escha.format import random_qweight

dw = importlib.import_module("escha.kernels.decode_wgmma")

for bits in (2, 3):
    qw = random_qweight(300, 700, bits=bits, seed=bits, device="cuda")
    for m in (1, 8, 16, 33, 64):
        x = torch.randn(m, 700, device="cuda", dtype=torch.bfloat16)
        cfg = dw.decode_wgmma_config(qw, m)
        steps = qw.padded_shape[0] // (64 * cfg.fragments) * (qw.padded_shape[1] // 128)
        for programs in (cfg.programs, steps, 1):  # each grid against the rule kernel on that grid
            want = dw.decode_wgmma(x, qw, config=dataclasses.replace(cfg, programs=programs))
            for regs in (64, 48)[:2 if cfg.block_tokens <= 32 else 1]:
                c = dataclasses.replace(cfg, loader=True, max_registers=regs, programs=programs)
                y = dw.decode_wgmma(x, qw, config=c)
                torch.cuda.synchronize()
                bad = int((y != want).sum())
                print(f"K={bits} M={m} cap={regs} programs={programs}: {bad} of {y.numel()} outputs differ")
