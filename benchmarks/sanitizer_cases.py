"""Every kernel over a grid of ragged shapes, gated against the reference: the workload that
benchmarks/run_sanitizer.sh runs under compute-sanitizer (memcheck, racecheck).

Each case fills its inputs with fresh random values, runs one path, and checks the result
against the fp32 reference, so an out-of-bounds read that happened to return plausible data
still shows up twice: once in the sanitizer's report and once as a gate failure here.
"""
from __future__ import annotations

import os
import sys

import torch

import escha
from escha.format import decode_trellis, random_qweight
from escha.kernels import dequantize_core
from escha.norm import HeadNorm
from escha.ops import available_paths

# (out, in): ragged against the 16-wide tiles, the 128-wide Hadamard blocks and the kernels' blocks.
SHAPES = [(1, 1), (17, 130), (200, 129), (257, 300), (130, 1000)]
MS = [1, 7, 64, 65, 130]
# racecheck replays every shared-memory access: a smaller grid that still has ragged edges.
if os.environ.get("ESCHA_SANITIZER_GRID") == "small":
    # 1: the transforms' one-token tiles; 1 and 7: the register-operand GEMM's halves codec at K=2;
    # 40 and 130: its 64-token variant (one fragment, a ring of 2) and two 128-token blocks.
    SHAPES, MS = [(17, 130), (257, 300)], [1, 7, 40, 130]
# A run for one kernel: ESCHA_SANITIZER_PATHS (comma-separated path names), ESCHA_SANITIZER_MS
# (comma-separated token counts) and ESCHA_SANITIZER_SHAPES (comma-separated OUTxIN) set the grid.
PATHS = set(filter(None, os.environ.get("ESCHA_SANITIZER_PATHS", "").split(",")))
if os.environ.get("ESCHA_SANITIZER_MS"):
    MS = [int(v) for v in os.environ["ESCHA_SANITIZER_MS"].split(",")]
if os.environ.get("ESCHA_SANITIZER_SHAPES"):  # "OUTxIN,..."
    SHAPES = [tuple(int(d) for d in v.split("x")) for v in os.environ["ESCHA_SANITIZER_SHAPES"].split(",")]
# Relative error bounds for bf16 outputs (docs/KERNELS.md tolerance tables): bf16 output rounding
# (2**-9) bounds the bf16-output paths, e4m3 operand rounding the fp8 ones.
TOL = {"reference": 1e-2, "decode": 1e-2, "decode-wgmma": 1e-2, "dequant-bf16": 2e-2, "prefill": 8e-2,
       "dequant-fp8": 8e-2, "dequant-core-fp8": 8e-2,
       "dequant-core-bf16": 2e-2, "decode-fp8": 8e-2}


def main() -> int:
    torch.manual_seed(0)
    failures = 0
    cases = 0
    for bits in (2, 3):
        for i, (n, k) in enumerate(SHAPES):
            qw = random_qweight(n, k, bits, seed=100 * bits + i, device="cuda")
            core = decode_trellis(qw)
            for dtype in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):
                t, s = dequantize_core(qw, dtype)
                want = core.to(dtype) if dtype != torch.float8_e4m3fn else (core.float() / s).to(dtype)
                ok = torch.equal(t.view(torch.uint8), want.view(torch.uint8))
                cases += 1
                failures += not ok
                if not ok:
                    print(f"FAIL dequant {dtype} K={bits} {n}x{k}")
            dense = escha.dequantize(qw)
            for m in MS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ dense.T
                norm = escha.RowNorm((torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16), 1e-6)
                ref_norm = norm.apply(x).float() @ dense.T
                # Per-head norms of the whole 128-row blocks (Qwen3's q_norm), in the output transform.
                nb = -(-n // 128)
                flags = (torch.arange(nb, device="cuda") < n // 128).to(torch.int8)
                head = HeadNorm((torch.rand(nb * 128, device="cuda") + 0.5).to(torch.bfloat16), flags, 1e-6)
                for path in available_paths(qw, m):
                    if PATHS and str(path) not in PATHS:
                        continue
                    # Each path alone, then with an RMSNorm applied first (in the input transform
                    # of the decode kernels).
                    plain = escha.matmul(x, qw, path=path)
                    for label, y, want in ((str(path), plain, ref),
                                           (f"{path}+norm", escha.matmul(x, qw, path=path, norm=norm), ref_norm),
                                           (f"{path}+heads", escha.matmul(x, qw, path=path, head_norm=head),
                                            head.apply(plain).float())):
                        rel = float((y.float() - want).norm() / want.norm().clamp_min(1e-30))
                        ok = bool(torch.isfinite(y).all()) and rel <= TOL[str(path)]
                        cases += 1
                        failures += not ok
                        if not ok:
                            print(f"FAIL {label} K={bits} {n}x{k} M={m}: rel {rel:.3e}")
    torch.cuda.synchronize()
    print(f"sanitizer cases: {cases} run, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
