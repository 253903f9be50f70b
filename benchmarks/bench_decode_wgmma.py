"""Register-operand decode GEMM on the H200: gates, then timings against cuBLAS and the portable kernel.

    python benchmarks/bench_decode_wgmma.py --out DIR [--rounds 5] [--ms 1,8,16,40,64,128,256] [--bits 2|3]
        [--shapes gate_up,down] [--variants] [--cap-variants] [--stage-variants] [--wave-variants]
        [--transform-variants] [--breakdown]
        [--previous FILE[,FILE...]]

Gates first (every (shape, M) before its timing): the A fragments bit for bit against the
reference codec, the GEMM against an fp64 reference within the decode tolerance table. Timing:
weights rotated over >= 4x L2, one CUDA graph per arm calling it once per weight, device events,
rounds interleaved across arms, median over rounds. With ``--previous`` (earlier versions of
escha/kernels/decode_wgmma.py, e.g. from ``git show REV:...`` saved as decode_wgmma_REV.py), each
version's rule is one more arm (``wgmma@REV``), gated as the others: a change measured against
what it replaces in one process. ``--transform-variants`` times the call at other launch shapes of
its input and output transforms (``transform_variants``), ``--cap-variants`` the rule's kernel built
under other register caps (``cap_variants``), ``--stage-variants`` with deeper TMA rings
(``stage_variants``), ``--wave-variants`` on a wave short of the build's capacity (``wave_variants``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import traceback

import torch
import triton

from escha.bench.cuda_timing import GraphTimer
from escha.bench.method import rotation_buffers, round_order
from escha.format import QuantizedWeight, decode_trellis, dequantize, random_qweight
from escha.kernels import decode
from escha.kernels.compile_check import programs_per_sm
from escha.kernels.decode_wgmma import (PROGRAMS_PER_SM, decode_wgmma, decode_wgmma_config, decoded_fragments,
                                        gemm_partials, grid_programs, mma_order_core, packed_words, tiles_and_steps)
from escha.kernels.transforms import hadamard_input, hadamard_output, input_blocks_per_program, output_shape

sys.path.insert(0, os.path.dirname(__file__))
from bench_decode import env_info, load_previous, revision, weight_set  # noqa: E402

# The seed shapes, two Llama-3-8B ones, and the narrow shards (where two k-blocks a program fall short of a
# wave): Qwen3-14B's q/k/v and o at tensor-parallel degree 4 and its o at 2, Llama-3-8B's q/k/v and o at 4
# and its o at 2; some of both at 8; the two down projections at 2 (inputs between the seed's two).
SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704), "qkv_8b": (6144, 4096), "down_8b": (4096, 14336),
          "down_tp2": (5120, 4352), "down_8b_tp2": (4096, 7168),
          "qkv_tp4": (1792, 5120), "o_tp4": (5120, 1280), "o_tp2": (5120, 2560),
          "qkv_8b_tp4": (1536, 4096), "o_8b_tp4": (4096, 1024), "o_8b_tp2": (4096, 2048),
          "qkv_tp8": (896, 5120), "o_tp8": (5120, 640), "o_8b_tp8": (4096, 512), "down_8b_tp8": (4096, 1792)}
TOL = {torch.bfloat16: 2 * (2.0**-8 + 2.0**-11), torch.float16: 2 * (2.0**-11 + 2.0**-11),
       torch.float32: 2 * (2.0**-24 + 2.0**-11)}


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def gate_fragments(log) -> bool:
    ok = True
    for bits in (2, 3):
        for out_f, in_f in ((128, 128), (300, 520), (17408, 5120)):
            qw = random_qweight(out_f, in_f, bits=bits, seed=out_f + bits, device="cuda")
            got = decoded_fragments(qw)
            want = mma_order_core(decode_trellis(qw).to(torch.float16))
            same = torch.equal(got.view(torch.int16), want.view(torch.int16))
            ok &= same
            log(f"fragments K={bits} {out_f}x{in_f}: {'bit-exact' if same else 'MISMATCH'}"
                + ("" if same else f" ({int((got.view(torch.int16) != want.view(torch.int16)).sum())} differ)"))
    return ok


def gate_gemm(qw: QuantizedWeight, w_ref: torch.Tensor, m: int, dtype: torch.dtype, cfg=None) -> float:
    """Relative error of one fresh random product against fp64 (output poisoned by a fresh alloc)."""
    x = torch.randn(m, qw.in_features, device="cuda", dtype=dtype)
    ref = x.double() @ w_ref.T
    y = decode_wgmma(x, qw, config=cfg)
    if not torch.isfinite(y).all():
        return float("nan")
    return rel_err(y, ref)


def time_arms(timer: GraphTimer, arms: dict, rounds: int) -> dict[str, float]:
    """Median µs of each arm {name: (fn(i), rotation length)}: one CUDA graph an arm, ``rounds``
    rounds interleaved across the arms, each round in the order of ``method.round_order`` (a
    Williams design, as ``escha bench`` orders its arms: no arm always runs right after the same
    one, whose clock and power state could carry into it). Until this form every round ran the
    arms in the dict's order."""
    samplers = {k: timer.build(fn, n, k) for k, (fn, n) in arms.items()}
    names = list(samplers)
    times = {k: [] for k in names}
    for r in range(rounds):
        for i in round_order(len(names), r):
            times[names[i]].append(samplers[names[i]].sample())
    return {k: statistics.median(v) for k, v in times.items()}


def one_wave(qw: QuantizedWeight, m: int, per_sm: int, tokens: int, fragments: int = 1) -> int:
    """Programs a token block of ``tokens`` takes so that all of m's blocks fill one wave at
    ``per_sm`` programs an SM, of ``fragments`` 64-row fragments (the rule's grid,
    ``decode_wgmma.grid_programs``, for another occupancy)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return grid_programs(tiles_and_steps(qw.padded_shape, fragments)[1], per_sm, sms, -(-m // tokens))


def variant_configs(cfg, qw: QuantizedWeight, m: int) -> dict:
    """Configurations beside the rule's, each one wave at the occupancy of its sm_90a build
    (cuobjdump registers and shared memory, offline): at 8-32 tokens the exact codec with one
    64-row fragment a program (64-95 registers: 5-8 programs an SM against two fragments' 4), and
    with two capped at 96 registers (5 an SM, 16-48 bytes of spill); where the rule takes the
    halves codec (K=2, 8 tokens) the exact codec's two fragments at 4 an SM (the rule before), the
    halves codec's, and the rule's capped at 80 and 64 registers (6 and 8 an SM); elsewhere up to
    32 tokens the halves codec (at 16 tokens also one fragment capped at 96 and 64); at 64
    tokens the cap of 168 (3 an SM) and one fragment (128 registers, 3 an SM by shared memory at
    3 stages, 4 at 2); where the rule caps the registers (K=3 at 32 and 64 tokens: 128, 4 an SM)
    the uncapped build at 3 an SM; above 128 tokens one token block of 256 (the rule takes blocks
    of 128)."""
    def wave(per_sm: int, tokens: int = cfg.block_tokens) -> int:
        return one_wave(qw, m, per_sm, tokens)

    out = {}
    if cfg.block_tokens <= 32:
        for k in (4, 6, 8):
            out[f"f1w{k}"] = dataclasses.replace(cfg, halves=False, fragments=1, programs=wave(k))
        if cfg.block_tokens <= 16:
            out["cap96w5"] = dataclasses.replace(cfg, halves=False, fragments=2, max_registers=96, programs=wave(5))
    if cfg.block_tokens == 8 and cfg.halves:  # the exact codec where the rule takes the halves one
        out["exact_f2w4"] = dataclasses.replace(cfg, halves=False, fragments=2, programs=wave(4))
        out["halves_f2w4"] = dataclasses.replace(cfg, fragments=2, programs=wave(4))
        # More warps for a latency-bound loop: the rule's build (96 registers) capped at 80 and 64
        # builds without spills (offline sm_90a, cuobjdump): 6 and 8 programs an SM.
        out["halves_f1w6c80"] = dataclasses.replace(cfg, max_registers=80, programs=wave(6))
        out["halves_f1w8c64"] = dataclasses.replace(cfg, max_registers=64, programs=wave(8))
    elif cfg.block_tokens <= 32:  # the halves codec: weights lo + hi unrounded
        out["halves"] = dataclasses.replace(cfg, halves=True)
        if cfg.block_tokens >= 16:  # 153 registers at 16 tokens, 74 KB of shared memory at 32: 3 an SM
            out["halves_w3"] = dataclasses.replace(cfg, halves=True, programs=wave(3))
        out["halves_f1w5"] = dataclasses.replace(cfg, halves=True, fragments=1, programs=wave(5))
        if cfg.block_tokens == 16:  # one fragment: 127 registers; capped at 96 and 64 without spills
            out["halves_f1w5c96"] = dataclasses.replace(cfg, halves=True, fragments=1, max_registers=96,
                                                        programs=wave(5))
            out["halves_f1w6c64"] = dataclasses.replace(cfg, halves=True, fragments=1, max_registers=64,
                                                        programs=wave(6))
    if cfg.block_tokens == 64:
        out["cap168"] = dataclasses.replace(cfg, max_registers=168, programs=wave(3))
        out["f1w3"] = dataclasses.replace(cfg, fragments=1, programs=wave(3))
        out["f1s2w4"] = dataclasses.replace(cfg, fragments=1, stages=2, programs=wave(4))
    if cfg.max_registers is not None:  # the rule's cap (K=3 at 32 and 64 tokens) lifted: the rule before
        out["uncapped"] = dataclasses.replace(cfg, max_registers=None, programs=wave(3))  # 137-165 registers
    if cfg.block_tokens == 128 and m > 128:  # one token block of 256 (1 program an SM, 2 stages)
        out["bn256"] = dataclasses.replace(cfg, block_tokens=256, stages=2, programs=wave(1, 256))
    return {k: v for k, v in out.items() if v != cfg}


#: The rule's variant under other ptxas register caps, by (K, token block): (label, changes to the
#: configuration, programs an SM). The programs an SM are those of each sm_90a build under triton
#: 3.6.0, and none of these builds spills (benchmarks/results/caps_offline/: registers, stack,
#: shared memory and the loop's SASS census of every cap). Two kinds: the same occupancy as the
#: rule's build (a cap changes ptxas's schedule even where the build keeps its registers; "none":
#: no cap, where the rule sets one), and one program an SM more where a cap of 96 builds without
#: spills (with a ring of 2 at 32 tokens). An arm equal to the rule's configuration is left out.
CAP_ARMS = {
    (2, 8): [("c96w5", {"max_registers": 96}, 5)],
    (2, 16): [("none", {"max_registers": None}, 4)]
             + [(f"c{c}w4", {"max_registers": c}, 4) for c in (128, 124, 120, 116, 112)],
    (2, 32): [("c96w4", {"max_registers": 96}, 4), ("s2c96w5", {"stages": 2, "max_registers": 96}, 5)],
    (2, 64): [("c128w4", {"max_registers": 128}, 4), ("c120w4", {"max_registers": 120}, 4),
              ("c96w5", {"max_registers": 96}, 5)],
    (3, 16): [(f"c{c}w4", {"max_registers": c}, 4) for c in (128, 124, 120)],
    (3, 32): [("s2c96w5", {"stages": 2, "max_registers": 96}, 5)],
    (3, 64): [("c120w4", {"max_registers": 120}, 4), ("c96w5", {"max_registers": 96}, 5)],
}


def cap_variants(cfg, qw: QuantizedWeight, m: int) -> dict:
    """The rule's configuration under the register caps of CAP_ARMS, each one wave at its build's
    programs an SM (``cap_<label>``)."""
    out = {}
    for label, changes, per_sm in CAP_ARMS.get((qw.bits, cfg.block_tokens), []):
        programs = one_wave(qw, m, per_sm, cfg.block_tokens, cfg.fragments)
        variant = dataclasses.replace(cfg, programs=programs, **changes)
        if variant != cfg:
            out[f"cap_{label}"] = variant
    return out


#: Deeper TMA rings for the rule's variant, by (K, token block): the stages whose sm_90a builds keep
#: the rule's registers, programs an SM and loop instructions under triton 3.6.0
#: (benchmarks/results/stages_offline/stages.txt): 5 programs an SM up to 5 stages at 8 tokens, 4
#: up to 4 stages at 16. ncu puts 6-9% of the warps' samples at 1-16 tokens on the ring's
#: mbarrier wait (benchmarks/results/sass_h200/).
STAGE_ARMS = {(2, 8): (4, 5), (3, 8): (4, 5), (2, 16): (4,), (3, 16): (4,)}


def stage_variants(cfg, qw: QuantizedWeight, m: int) -> dict:
    """The rule's configuration with the deeper rings of STAGE_ARMS (``stages<n>``), on the rule's
    grid (the builds keep its programs an SM)."""
    return {f"stages{n}": dataclasses.replace(cfg, stages=n)
            for n in STAGE_ARMS.get((qw.bits, cfg.block_tokens), ()) if n != cfg.stages}


def wave_variants(cfg, qw: QuantizedWeight, m: int) -> dict:
    """A wave one program an SM short of the build's capacity (PROGRAMS_PER_SM - 1 an SM, every
    program the same number of steps), started early (``w<n>``) and late (``w<n>_late``); where the
    rule caps the registers, the uncapped build at the rule's wave and at the shorter one
    (``uncapped_w<n>``: at M a multiple of 16 the uncapped K=3 64-token build holds 4 an SM, as
    the capped one). What they test: whether a wave below the capacity of the kernel launched,
    with the GEMM launched while the input transform still holds SMs, leaves programs unevenly
    over the SMs (the SMs free first taking up to the capacity) and so a tail."""
    per_sm = PROGRAMS_PER_SM[(qw.bits, cfg.block_tokens)]
    short = one_wave(qw, m, per_sm - 1, cfg.block_tokens, cfg.fragments)
    out = {f"w{per_sm - 1}": dataclasses.replace(cfg, programs=short),
           f"w{per_sm - 1}_late": dataclasses.replace(cfg, programs=short, early_start=False)}
    if cfg.max_registers is not None:
        out[f"uncapped_w{per_sm}"] = dataclasses.replace(cfg, max_registers=None)
        out[f"uncapped_w{per_sm - 1}"] = dataclasses.replace(cfg, max_registers=None, programs=short)
    return out


def build_capacity(qw: QuantizedWeight, m: int, cfg) -> tuple[int, int, int]:
    """(programs an SM, registers, shared bytes) of the GEMM build ``cfg`` launches at m tokens:
    compiled by one launch, its occupancy from its registers and shared memory
    (``compile_check.programs_per_sm``, four warps a program)."""
    from escha.kernels.decode_wgmma import _gemm, _packed
    x = torch.randn(m, qw.in_features, device="cuda", dtype=torch.bfloat16)
    xq, _ = hadamard_input(x, qw, mma_order=True, halves=cfg.halves)
    _, _, prep = _gemm(xq, qw, dataclasses.replace(cfg, programs=1, dependent_launch=False, early_start=False),
                       _packed(qw), keep=True)
    regs, smem = prep.compiled.n_regs, prep.compiled.metadata.shared
    return programs_per_sm(regs, smem), regs, smem


def at_capacity(variants: dict, qw: QuantizedWeight, m: int, log=print) -> dict:
    """Each variant on one wave at its build's measured capacity (``build_capacity``) instead of
    the programs an SM its table assumed (offline builds of another codec may hold more or fewer),
    since a wave short of the capacity, started early, loses 8-21% ("waves_h200")."""
    out = {}
    for label, c in variants.items():
        per_sm, regs, smem = build_capacity(qw, m, c)
        log(f"  {label}: {regs} registers, {smem} B shared, {per_sm} programs an SM")
        out[label] = dataclasses.replace(c, programs=one_wave(qw, m, per_sm, c.block_tokens, c.fragments))
    return out


def transform_variants(cfg, qw: QuantizedWeight, m: int) -> dict:
    """The rule's configuration with other launch shapes of the call's transforms: the input
    transform at 1-32 Hadamard blocks a program (``in_b*``), the output transform at 1-16 tokens
    a program with 4 warps, and with 1 or 2 warps at 1-2 tokens (``out_t*w*``; more tokens with
    fewer warps hold 50-255 registers in the offline census), the rule's own shapes left out."""
    blocks = qw.padded_shape[1] // 128
    rule_blocks = cfg.input_blocks or input_blocks_per_program(m, blocks)
    out = {f"in_b{b}": dataclasses.replace(cfg, input_blocks=b) for b in (1, 2, 4, 8, 16, 32)
           if b != rule_blocks and b <= 2 * blocks}
    rule_shape = cfg.output_shape or output_shape(m, qw.padded_shape[0])
    for tokens in (1, 2, 4, 8, 16):
        for warps in (1, 2, 4):
            if (tokens, warps) != rule_shape and tokens <= triton.next_power_of_2(m) and (warps == 4 or tokens <= 2):
                out[f"out_t{tokens}w{warps}"] = dataclasses.replace(cfg, output_shape=(tokens, warps))
    return out


def start_run(out: str, log_name: str, gate=None) -> tuple:
    """The output folder, a logger that prints and appends to ``out/log_name``, and the results
    dict with the environment and, given one, the fragments gate (``gate(log)``) recorded: what
    the decode benchmarks do before their first point."""
    os.makedirs(out, exist_ok=True)

    def log(s: str) -> None:
        print(s, flush=True)
        with open(os.path.join(out, log_name), "a") as f:
            f.write(s + "\n")

    env = env_info()
    log(json.dumps(env))
    results = {"env": env, "gates": {}, "points": []}
    if gate is not None:
        try:
            results["gates"]["fragments"] = gate(log)
        except Exception:
            log(traceback.format_exc())
    return log, results


def dense_weights(out_f: int, in_f: int, l2: int) -> list[torch.Tensor]:
    """bf16 [out_f, in_f] weights for cuBLAS, enough of them to rotate past L2."""
    return [torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
            for _ in range(max(2, rotation_buffers(l2, out_f * in_f * 2)))]


def fp8_weights(dense_rot: list[torch.Tensor], l2: int) -> list[torch.Tensor]:
    """e4m3 copies of the first ``dense_rot`` weights, enough of them to rotate past L2."""
    out_f, in_f = dense_rot[0].shape
    return [w.to(torch.float8_e4m3fn) for w in dense_rot[:max(2, rotation_buffers(l2, out_f * in_f))]]


def cublas_arms(xs: list[torch.Tensor], dense_rot: list[torch.Tensor],
                fp8_rot: list[torch.Tensor] | None = None) -> dict:
    """The cuBLAS arms on the activations ``xs`` (two, alternated): bf16 over ``dense_rot`` and,
    given ``fp8_rot``, fp8 (``torch._scaled_mm``, row-wise scales, the operands already e4m3: its
    activation quantization is not timed)."""
    arms = {"cublas_bf16": (lambda i: xs[i % 2] @ dense_rot[i % len(dense_rot)].T, len(dense_rot))}
    if fp8_rot is not None:
        x8 = xs[0].to(torch.float8_e4m3fn)
        xscale = torch.ones(xs[0].shape[0], device="cuda")
        wscale = torch.ones(fp8_rot[0].shape[0], device="cuda")
        arms["cublas_fp8"] = (lambda i: torch._scaled_mm(x8, fp8_rot[i % len(fp8_rot)].T, scale_a=xscale[:, None],
                                                          scale_b=wscale[None, :], out_dtype=torch.bfloat16),
                              len(fp8_rot))
    return arms


def packed_weights(name: str, bits: int, l2: int, previous: dict) -> tuple:
    """The rotation set of a shape's K=bits weights (>= 4x L2 of packed words, which are 2x the
    trellis at K=2 and 4/3 of it at K=3), repacked outside the timed graphs for today's kernel and
    each ``previous`` module, the first weight's fp64 dequantization, and bf16 weights rotated
    past L2 for cuBLAS."""
    out_f, in_f = SHAPES[name]
    ws = weight_set(out_f, in_f, 4 * l2 / (2 if bits == 2 else 4 / 3), seed=len(name), bits=bits)
    for w in ws:
        packed_words(w)
        for mod in previous.values():
            mod.packed_words(w)
    return ws, dequantize(ws[0]).double(), dense_weights(out_f, in_f, l2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="1,8,16,40,64,128,256")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--bits", type=int, default=2, choices=(2, 3), help="K of the weights timed")
    ap.add_argument("--variants", action="store_true", help="also time fragments x grid variants")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the call's three kernels each by itself (stream order, no dependent launch)")
    ap.add_argument("--cap-variants", action="store_true",
                    help="also time the rule's kernel built under other register caps (CAP_ARMS)")
    ap.add_argument("--wave-variants", action="store_true",
                    help="also time waves one program an SM short of the build's capacity, started early and late")
    ap.add_argument("--stage-variants", action="store_true",
                    help="also time the rule's kernel with deeper TMA rings that keep its programs an SM (STAGE_ARMS)")
    ap.add_argument("--transform-variants", action="store_true",
                    help="also time the call with other launch shapes of its transforms (the input transform's "
                         "blocks a program; the output transform's tokens and warps a program)")
    ap.add_argument("--previous", help="earlier decode_wgmma.py files, comma-separated, each timed as an arm wgmma@REV")
    args = ap.parse_args()
    previous = {"wgmma@" + revision(f): load_previous(f) for f in (args.previous.split(",") if args.previous else [])}
    log, results = start_run(args.out, "decode_wgmma.log", gate_fragments)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    timer = GraphTimer(replays=10)
    for name in args.shapes.split(","):
        out_f, in_f = SHAPES[name]
        ws, w_ref, dense_rot = packed_weights(name, args.bits, l2, previous)
        for m in [int(v) for v in args.ms.split(",")]:
            point = {"shape": name, "N": out_f, "K": in_f, "M": m, "bits": args.bits}
            try:
                for dt in (torch.bfloat16, torch.float16, torch.float32):
                    e = gate_gemm(ws[0], w_ref, m, dt)
                    point[f"err_{str(dt)[6:]}"] = e
                    if not e <= TOL[dt]:
                        log(f"GATE FAIL {name} M={m} {dt}: {e:.3e} > {TOL[dt]:.3e}")
                xs = [torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
                cfg = decode_wgmma_config(ws[0], m)
                arms = {**cublas_arms(xs, dense_rot),
                        "wgmma": (lambda i: decode_wgmma(xs[i % 2], ws[i], config=cfg), len(ws))}
                # The launch-order choices of the same kernels: plain stream order, and programmatic
                # dependents with the GEMM starting early (as the input transform starts) or late.
                for arm, pdl, early in (("plain", False, False), ("pdl_early", True, True), ("pdl_late", True, False)):
                    c2 = dataclasses.replace(cfg, dependent_launch=pdl, early_start=early)
                    if c2 != cfg:
                        arms[f"wgmma_{arm}"] = (lambda i, c2=c2: decode_wgmma(xs[i % 2], ws[i], config=c2), len(ws))
                for label, mod in previous.items():
                    cp = mod.decode_wgmma_config(ws[0], m)
                    x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
                    e = rel_err(mod.decode_wgmma(x, ws[0], config=cp), x.double() @ w_ref.T)
                    point[f"err_{label}"] = e
                    if e <= TOL[torch.bfloat16]:
                        arms[label] = (lambda i, c=cp, mod=mod: mod.decode_wgmma(xs[i % 2], ws[i], config=c), len(ws))
                    else:
                        log(f"GATE FAIL {name} M={m} {label}: {e:.3e}")
                if m <= 64:
                    arms["portable"] = (lambda i: decode(xs[i % 2], ws[i]), len(ws))
                if args.breakdown:
                    # Each kernel of a call alone, on the operands a call gives it; "part_sum" (added
                    # below) against "wgmma_plain" is what launching them back to back costs.
                    plain = dataclasses.replace(cfg, dependent_launch=False, early_start=False)
                    xq, inv = hadamard_input(xs[0], ws[0], mma_order=True, halves=plain.halves)
                    zs, counts = gemm_partials(xq, ws[0], plain)
                    y = torch.empty(m, out_f, device="cuda", dtype=torch.bfloat16)
                    arms["part_input"] = (lambda i: hadamard_input(xs[i % 2], ws[i], mma_order=True, halves=plain.halves),
                                          len(ws))
                    arms["part_gemm"] = (lambda i: gemm_partials(xq, ws[i], plain), len(ws))
                    arms["part_output"] = (lambda i: hadamard_output(zs, ws[i], inv, y, segments=counts), len(ws))

                    def input_and_gemm(i: int, c=cfg) -> torch.Tensor:
                        # The call's first two launches as the call makes them (the rule's start),
                        # without the output transform: what a call with its output transform
                        # fused into the GEMM could at best take.
                        xq_i, _ = hadamard_input(xs[i % 2], ws[i], mma_order=True, halves=c.halves,
                                                 dependent_launch=c.dependent_launch,
                                                 release_early=c.dependent_launch and c.early_start)
                        return gemm_partials(xq_i, ws[i], c)[0]
                    arms["input_and_gemm"] = (input_and_gemm, len(ws))
                variants = {**(at_capacity(variant_configs(cfg, ws[0], m), ws[0], m, log) if args.variants else {}),
                            **(transform_variants(cfg, ws[0], m) if args.transform_variants else {}),
                            **(cap_variants(cfg, ws[0], m) if args.cap_variants else {}),
                            **(stage_variants(cfg, ws[0], m) if args.stage_variants else {}),
                            **(wave_variants(cfg, ws[0], m) if args.wave_variants else {})}
                for label, c2 in variants.items():  # each gated against fp64 before it is timed
                    e = gate_gemm(ws[0], w_ref, m, torch.bfloat16, cfg=c2)
                    point[f"err_{label}"] = e
                    if not e <= TOL[torch.bfloat16]:
                        log(f"GATE FAIL {name} M={m} {label}: {e:.3e}")
                        continue
                    arms[label] = (lambda i, c2=c2: decode_wgmma(xs[i % 2], ws[i], config=c2), len(ws))
                med = time_arms(timer, arms, args.rounds)
                if args.breakdown:
                    med["part_sum"] = med["part_input"] + med["part_gemm"] + med["part_output"]
                point["us"] = med
                point["config"] = dataclasses.asdict(cfg)
                log(f"{name} M={m:4d} " + " ".join(f"{k} {v:7.1f}" for k, v in med.items())
                    + f"  wgmma/bf16 {med['wgmma'] / med['cublas_bf16']:.3f}  err_bf16 {point['err_bfloat16']:.2e}")
            except Exception:
                log(f"{name} M={m}: " + traceback.format_exc())
            results["points"].append(point)
            with open(os.path.join(args.out, "decode_wgmma.json"), "w") as f:
                json.dump(results, f, indent=1)
        ws = w_ref = dense_rot = None  # freed before the next shape (a rebinding: the arms name ws)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
