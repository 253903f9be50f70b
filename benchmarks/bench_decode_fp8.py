"""The fp8 decode GEMM on the H200: gates, then timings against cuBLAS and escha's other paths.

    python benchmarks/bench_decode_fp8.py --out DIR [--rounds 3] [--ms 64,128,192,256,384,512,640,768,1024]
        [--shapes gate_up,down,down_8b] [--bits 2|3] [--uncapped] [--build-variants]
        [--previous FILE,...]

Gates first: the e4m3 fragments bit for bit against the reference codec; at every point, before
its timing, the call against fp64 within the fp8 table (0.077) and the GEMM's partials against the
exact product of its own e4m3 operands (2**-8; tests/test_decode_fp8.py derives both). Timing as
bench_decode_wgmma.py: weights rotated over >= 4x L2, one CUDA graph an arm, device events, rounds
interleaved across arms, median. Arms: cuBLAS bf16; cuBLAS fp8 (torch._scaled_mm, row-wise
scales, operands already e4m3: its activation quantization is not timed); escha.matmul's rule
(decode_fp8 itself from 129 to 512 tokens);
the fp16 register-operand kernel (decode_wgmma's rule); the plain-core dequantize-once path
(dequant-core-fp8); decode_fp8's rule, and above 128 tokens its blocks of 128 (``fp8_bn128``).
With ``--build-variants``, blocks of 128 tokens also in the builds of BUILD_ARMS (128 weight rows a
program over 8 warps, capped at 128 registers: two programs an SM, each activation tile read once
per 128 rows instead of 64), each on one wave of its own occupancy. With ``--previous
FILE[,FILE...]`` (earlier versions of escha/kernels/decode_fp8.py, e.g. made by
``benchmarks/snapshot_kernels.sh LABEL REV`` as .prev/decode_fp8_LABEL.py), each version's rule
is one more arm (``fp8@LABEL``, the file name's last ``_`` field), gated as the others: a change
measured against what it replaces in one process.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import torch

import escha
from escha.bench.cuda_timing import GraphTimer
from escha.format import random_qweight
from escha.kernels.decode_fp8 import (config_with_block, decode_fp8, decode_fp8_config, decoded_fragments, gemm_partials,
                                      mma_order, partial_values, reference_core, wave_programs)
from escha.kernels.decode_wgmma import decode_wgmma, summed_partials
from escha.kernels.dequant_once import dequant_core_fp8
from escha.kernels.transforms import prepare_input

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import load_previous, revision  # noqa: E402
from bench_decode_wgmma import (SHAPES, cublas_arms, fp8_weights, packed_weights, rel_err,  # noqa: E402
                               start_run, time_arms)

FP8_TOL = 0.077  # tests/test_decode_fp8.py
PARTIALS_TOL = 2.0**-8  # tests/test_decode_fp8.py

#: Builds of the 128-token block beside the rule's (4 warps over 64 rows, a ring of 2, capped at
#: 168: 3 programs an SM): (label, changes to the configuration, programs an SM). 8 warps over
#: 128 rows hold 183 registers uncapped (1 an SM) and 128 capped, with no stack, 64 KB of shared
#: memory at a ring of 2 and 80 KB at 3: 2 an SM, 16 warps against the rule's 12, and each
#: activation tile read once per 128 weight rows (sm_90a, triton 3.6.0, K=2:
#: benchmarks/results/fp8_builds/builds.txt). The 256-token build (8 x 2 warps) gained from its
#: 128-row tiles over 4 warps' 64 (79.6 against 88.7 us on gate_up; note in decode_fp8.py); at
#: 128 tokens only warpgroups along the tokens were timed.
BUILD_ARMS = [("w8s2c128", {"warps_m": 8, "stages": 2, "max_registers": 128}, 2),
              ("w8s3c128", {"warps_m": 8, "stages": 3, "max_registers": 128}, 2)]


def build_variants(qw, m: int) -> dict:
    """Blocks of 128 tokens in the builds of BUILD_ARMS (``fp8_bn128_<label>``), each on one wave
    at its programs an SM (decode_fp8's grid rule, ``wave_programs``)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = config_with_block(qw, m, 128, torch.device("cuda"))
    return {f"fp8_bn128_{label}": dataclasses.replace(
                base, programs=wave_programs(qw.padded_shape, m, 128, changes["warps_m"], per_sm, sms), **changes)
            for label, changes, per_sm in BUILD_ARMS}


def gate_fragments(log) -> bool:
    ok = True
    for bits in (2, 3):
        for out_f, in_f in ((300, 520), (17408, 5120)):
            qw = random_qweight(out_f, in_f, bits=bits, seed=out_f + bits, device="cuda")
            want = mma_order(reference_core(qw)).view(torch.uint8)
            same = all(torch.equal(decoded_fragments(qw, wn).view(torch.uint8), want) for wn in (1, 2))
            ok &= same
            log(f"fragments K={bits} {out_f}x{in_f}: {'bit-exact' if same else 'MISMATCH'}")
    return ok


def gate_point(qw, w_ref: torch.Tensor, m: int, cfg) -> tuple[float, float]:
    """(whole call against fp64, summed partials against the exact e4m3 product), fresh inputs."""
    x = torch.randn(m, qw.in_features, device="cuda", dtype=torch.bfloat16)
    y = decode_fp8(x, qw, config=cfg)
    e_call = rel_err(y, x.double() @ w_ref.T) if torch.isfinite(y).all() else float("nan")
    xq, _, _ = prepare_input(x, qw, keep=False, fp8=True, mma_order=True)
    ws, counts = gemm_partials(xq, qw, cfg)
    got = summed_partials(partial_values(ws, m), counts)
    ref = xq.double() @ mma_order(reference_core(qw)).double().T
    return e_call, float((got - ref).norm() / ref.norm())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ms", default="64,128,192,256,384,512,640,768,1024")
    ap.add_argument("--shapes", default="gate_up,down,down_8b")
    ap.add_argument("--bits", type=int, default=2, choices=(2, 3))
    ap.add_argument("--previous", help="earlier decode_fp8.py files, comma-separated, each timed as an arm fp8@REV")
    ap.add_argument("--uncapped", action="store_true",
                    help="also the rule's build without its register cap (arm fp8_uncapped), where the rule sets one")
    ap.add_argument("--build-variants", action="store_true",
                    help="also blocks of 128 tokens in the builds of BUILD_ARMS (arms fp8_bn128_<label>)")
    args = ap.parse_args()
    previous = {"fp8@" + revision(f): load_previous(f) for f in (args.previous.split(",") if args.previous else [])}
    log, results = start_run(args.out, "decode_fp8.log", gate_fragments)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        ws, w_ref, dense_rot = packed_weights(name, args.bits, l2, {})
        fp8_rot = fp8_weights(dense_rot, l2)
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": name, "N": out_f, "K": in_f, "M": m, "bits": args.bits}
            try:
                cfg = decode_fp8_config(ws[0], m, torch.device("cuda"))
                configs = {"fp8": cfg}
                if m > 128:  # blocks of 128 (each weight decoded once a block), 3 programs an SM
                    configs["fp8_bn128"] = config_with_block(ws[0], m, 128, torch.device("cuda"))
                if args.uncapped and cfg.max_registers is not None:  # the same grid, ptxas's own registers
                    configs["fp8_uncapped"] = dataclasses.replace(cfg, max_registers=None)
                if args.build_variants and m > 64:
                    configs.update(build_variants(ws[0], m))
                xs = [torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                arms = {
                    **cublas_arms(xs, dense_rot, fp8_rot),
                    "escha": (lambda i: escha.matmul(xs[i % 2], ws[i]), len(ws)),
                    "wgmma": (lambda i: decode_wgmma(xs[i % 2], ws[i]), len(ws)),
                    "core_fp8": (lambda i: dequant_core_fp8(xs[i % 2], ws[i]), len(ws)),
                }
                for label, mod in previous.items():
                    cp = mod.decode_fp8_config(ws[0], m, torch.device("cuda"))
                    e_prev = rel_err(mod.decode_fp8(xs[0], ws[0], config=cp), xs[0].double() @ w_ref.T)
                    point[f"err_{label}"] = e_prev
                    if e_prev <= FP8_TOL:
                        arms[label] = (lambda i, c=cp, mod=mod: mod.decode_fp8(xs[i % 2], ws[i], config=c), len(ws))
                    else:
                        log(f"GATE FAIL {name} M={m} {label}: call {e_prev:.3e}")
                for label, c in configs.items():
                    e_call, e_part = gate_point(ws[0], w_ref, m, c)
                    point[f"err_{label}"], point[f"err_partials_{label}"] = e_call, e_part
                    if not (e_call <= FP8_TOL and e_part <= PARTIALS_TOL):
                        log(f"GATE FAIL {name} M={m} {label}: call {e_call:.3e}, partials {e_part:.3e}")
                        continue
                    arms[label] = (lambda i, c=c: decode_fp8(xs[i % 2], ws[i], config=c), len(ws))
                med = time_arms(timer, arms, args.rounds)
                point["us"] = med
                point["config"] = dataclasses.asdict(cfg)
                ratio = f"  fp8/bf16 {med['fp8'] / med['cublas_bf16']:.3f}" if "fp8" in med else ""
                log(f"{name} M={m:4d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items()) + ratio
                    + f"  err {point.get('err_fp8', float('nan')):.2e} partials {point.get('err_partials_fp8', float('nan')):.2e}")
            except Exception:
                log(f"{name} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "decode_fp8.json"), "w") as f:
                json.dump(results, f, indent=1)
        ws = w_ref = dense_rot = fp8_rot = None  # freed before the next shape (a rebinding: the arms name ws)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
