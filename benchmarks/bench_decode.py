"""Decode GEMM benchmark on the GPU: escha vs bf16 cuBLAS, ablations, config sweep, SASS census.

    python benchmarks/bench_decode.py --out DIR [--sweep] [--rounds 5]

Method: weights rotated over enough distinct buffers that the working set is >= 4x L2; each arm
is a CUDA graph that calls the kernel once per buffer; a round times `REPLAYS` replays with device
events; rounds interleave the arms; the reported time is the median over rounds, per call. The
gate (vs an fp32 reference) runs for every (shape, M) immediately before its timing.
"""
from __future__ import annotations

import argparse
import os
import datetime
import json
import re
import statistics
import subprocess
import sys
from dataclasses import asdict, replace

import torch

from escha.format import QuantizedWeight, dequantize, random_qweight
from escha.bench.method import round_order
from escha.bench.report import git_sha
from escha.kernels import CodecPath, decode, decode_config
from escha.kernels._bench import Ablation, decode_ablated, decode_kernel_handle
from escha.kernels.compile_check import cuobjdump, programs_per_sm, res_usage  # noqa: F401 (the census scripts import them from here)

SHAPES = {"gate_up": (17408, 5120), "down": (5120, 8704)}
MS = (1, 8, 40, 64)
REPLAYS = 10
# Integer-pipe ops counted toward the codec's issue floor (64/clk/SM on Hopper). SGXT is the 16-bit mask
# of a K=3 state (and.b32 0xFFFF compiles to SGXT.U32): 40 a step of the K=3 decode loop.
INT_OPS = ("IMAD", "IADD3", "VIADD", "SHF", "LOP3", "PRMT", "LEA", "SEL", "ISETP", "IMNMX", "SHL", "SHR", "IABS",
           "SGXT")
TOL_BF16 = 2 * (2.0**-8 + 2.0**-11)


def env_info() -> dict:
    import triton
    p = torch.cuda.get_device_properties(0)
    try:
        clk = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        clk = ""
    return {"gpu": p.name, "sms": p.multi_processor_count, "l2_bytes": p.L2_cache_size, "torch": torch.__version__,
            "triton": triton.__version__, "python": sys.version.split()[0], "git": git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "clocks_mhz": clk}


def revision(path: str) -> str:
    """REV of an earlier kernel file saved as NAME_REV.py (e.g. decode_fp8_REV.py from ``git show
    REV:escha/kernels/decode_fp8.py``): the last ``_`` field of its name."""
    return os.path.splitext(os.path.basename(path))[0].rsplit("_", 1)[-1]


def load_previous(path: str):
    """An earlier kernel file as a module of ``escha.kernels`` (its relative imports resolve
    against today's package): the ``--previous`` arms of bench_decode_fp8 and bench_decode_wgmma."""
    import importlib.util
    name = "escha.kernels._" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def weight_set(out_f: int, in_f: int, min_bytes: float, seed: int = 0, bits: int = 2) -> list[QuantizedWeight]:
    """Distinct random K=bits weights on the GPU whose trellis words total >= min_bytes."""
    base = random_qweight(out_f, in_f, bits=bits, seed=seed, device="cuda")
    nbytes = base.trellis.numel() * 4
    n = max(2, -(-int(min_bytes) // nbytes))
    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = [base]
    for _ in range(n - 1):
        tr = torch.randint(-2**31, 2**31, base.trellis.shape, generator=g, device="cuda", dtype=torch.int64).to(torch.int32)
        ws.append(QuantizedWeight(tr, base.su, base.sv, base.scale, base.gscale, base.shape, bits))
    return ws


def graph_of(fn, items) -> torch.cuda.CUDAGraph:
    """A CUDA graph that calls fn(item) once per item (after a warm-up outside capture)."""
    for it in items[:2]:
        fn(it)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(items[0])
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for it in items:
            fn(it)
    return g


def time_graph(g: torch.cuda.CUDAGraph, calls: int) -> float:
    """Microseconds per call over REPLAYS replays of a graph holding `calls` calls."""
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(REPLAYS):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0 / (REPLAYS * calls)


def interleaved(arms: dict, rounds: int) -> dict:
    """arms: name -> (graph, calls). Median over rounds of per-call microseconds."""
    res = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds):
        for i in round_order(len(names), r):  # no arm always after the same one
            g, c = arms[names[i]]
            res[names[i]].append(time_graph(g, c))
    return {k: statistics.median(v) for k, v in res.items()}


def gate(qw: QuantizedWeight, m: int, cfg) -> float:
    g = torch.Generator(device="cuda").manual_seed(1000 + m)
    x = (torch.randn(m, qw.in_features, device="cuda", generator=g) * 2).to(torch.bfloat16)
    y = decode(x, qw, config=cfg)
    ref = x.double() @ dequantize(qw).double().T
    err = ((y.double() - ref).norm() / ref.norm()).item()
    if not err < TOL_BF16:
        raise SystemExit(f"GATE FAILED: rel err {err:.3e} for {qw.shape} M={m} {cfg}")
    return err


def sass_census(kernel, cfg) -> dict:
    """Opcode counts in the main loop body (the longest backward-branch region) of the SASS."""
    return census_from_sass(kernel.asm["sass"], cfg, getattr(kernel, "n_regs", None),
                            getattr(kernel, "n_spills", None))


def compile_in_child(source: str, tree: str, args: tuple[str, ...] = (), timeout: float = 1200,
                     what: str = "the kernels"):
    """Run ``source``, a script that compiles kernels (sm_90a, no GPU needed) and prints JSON, in a
    fresh process with ``tree`` first on its path and without Triton's interpreter (compiling
    Gluon and running the interpreter in one process interfere); returns its parsed output."""
    import tempfile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "compile_census.py")  # @jit needs a source file
        with open(script, "w") as f:
            f.write(source)
        run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env,
                             timeout=timeout, cwd=tmp)
    if run.returncode != 0:
        raise SystemExit(f"compiling {what} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout)


def sass_instructions(sass: str) -> tuple[list[str], dict[str, int]]:
    """The instructions of a SASS listing in order, and each label's position among them.

    Understands both disassembly styles: labels ``LBB0:`` with ``ctrl<TAB>OP ...;`` lines (the
    Triton handle's ``asm['sass']``) and ``/*addr*/ OP ...;`` lines with ``.L_x_N:`` labels.
    """
    instrs, labels = [], {}
    for ln in sass.splitlines():
        lm = re.match(r"^\s*(\.?L\w+):\s*$", ln)
        if lm:
            labels[lm.group(1)] = len(instrs)
            continue
        im = re.match(r"^\s*(?:/\*[0-9a-f]+\*/|[-\w]+:[-\w]+:[-\w]+:[-\w]+:\w+)\s+(.*?)\s*;", ln)
        if im:
            instrs.append(im.group(1))
    return instrs, labels


def opcode_counts(instrs: list[str]) -> dict[str, int]:
    """Opcode counts of instructions, predicates and modifiers stripped (``@P0 LOP3.LUT`` is ``LOP3``)."""
    counts: dict[str, int] = {}
    for ins in instrs:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return counts


def branches(instrs: list[str], labels: dict[str, int], addresses: bool = False) -> list[tuple[int, int]]:
    """(position, target position) of every branch to a label of the listing; with ``addresses``
    also of those to an address, which the disassembler leaves unlabelled (``@P0 BRA P1,
    0x2e00``: a kernel's instructions are 16 bytes each from address 0, so the target's position
    is the address / 16)."""
    out = []
    for i, ins in enumerate(instrs):
        bm = re.search(r"BRA\s+`?\(?(\.?L\w+)", ins)
        am = re.search(r"BRA\s+(?:U?!?P\w+,\s*)?0x([0-9a-f]+)\s*$", ins) if addresses else None
        if bm and bm.group(1) in labels:
            out.append((i, labels[bm.group(1)]))
        elif am:
            out.append((i, int(am.group(1), 16) // 16))
    return out


def loop_region(sass: str, containing: str | None = None) -> tuple[list[str], dict[str, int], int, int]:
    """The listing's instructions and labels (``sass_instructions``) and the first and last
    position of the loop body: the longest region closed by a backward branch; with
    ``containing`` (an opcode), the shortest region closed by a predicated backward branch that
    holds it (the innermost loop around it, where an outer loop encloses the step loop; an
    unconditional jump back, as from out-of-line code to the middle of a loop, closes none). (0,
    0) when there is none."""
    instrs, labels = sass_instructions(sass)
    regions = [(target, i) for i, target in branches(instrs, labels) if target <= i]
    if containing is not None:
        regions = [r for r in regions if instrs[r[1]].startswith("@")
                   and containing in opcode_counts(instrs[r[0]:r[1] + 1])]
        best = min(regions, key=lambda r: r[1] - r[0], default=(0, 0))
    else:
        best = max(regions, key=lambda r: r[1] - r[0], default=(0, 0))
    return instrs, labels, best[0], best[1]


def steady_loop(sass: str) -> tuple[list[str], int]:
    """The instructions of a decode GEMM's step loop as it runs between tile ends, and how many
    instructions of the tile-end store they leave out: the loop is the longest region closed by
    a predicated backward branch (its back edge; ``loop_region`` may take the unconditional
    return from an out-of-line wait retry instead), the store the first forward branch in it that
    skips more than 40 instructions."""
    instrs, _ = sass_instructions(sass)
    first, s0, s1, last = steady_loop_span(sass)
    return instrs[first:s0 + 1] + instrs[s1:last + 1], s1 - s0 - 1


def steady_loop_span(sass: str) -> tuple[int, int, int, int]:
    """Positions (in ``sass_instructions``' order) of ``steady_loop``'s parts: the loop runs from
    the first to the last, the tile-end store's branch is at the second and its target the third."""
    instrs, labels = sass_instructions(sass)
    jumps = branches(instrs, labels, addresses=True)
    first, last = max(((t, i) for i, t in jumps if t <= i and instrs[i].startswith("@")), key=lambda r: r[1] - r[0])
    s0, s1 = next((i, t) for i, t in jumps if first <= i and i + 40 < t <= last)
    return first, s0, s1, last


def loop_census(sass: str, containing: str | None = None) -> dict[str, int]:
    """Opcode counts of the loop body (``loop_region``; ``opcode_counts``' stripping)."""
    instrs, _, first, last = loop_region(sass, containing)
    return opcode_counts(instrs[first:last + 1])


def census_from_sass(sass: str, cfg, regs=None, spills=None) -> dict:
    """``loop_census`` of the portable decode kernel, per weight of its [block_n, 16 block_kt] step."""
    counts = loop_census(sass)
    body = sum(counts.values())
    weights_per_iter = cfg.block_n * cfg.block_kt * 16
    lanes = 32 * cfg.num_warps
    int_ops = sum(counts.get(k, 0) for k in INT_OPS)
    return {"body_instructions": body, "counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            "int_ops": int_ops, "int_ops_per_weight": int_ops * lanes / weights_per_iter,
            "all_ops_per_weight": body * lanes / weights_per_iter,
            "registers": regs, "spills": spills}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sweep", action="store_true", help="also time config variants at M=8 and M=64")
    ap.add_argument("--ablate", action="store_true", help="also time codec-only / loads-only variants")
    ap.add_argument("--final", action="store_true", help="also time the runners-up of the sweep")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = env_info()
    l2 = info["l2_bytes"]
    clock_ghz = float(info["clocks_mhz"].split(",")[-1]) / 1000 if info["clocks_mhz"] else 1.98
    sms = info["sms"]
    print(json.dumps(info))
    rows, census = [], {}
    for name, (n, k) in SHAPES.items():
        qws = weight_set(n, k, 4 * l2)
        dense_n = max(2, -(-4 * l2 // (n * k * 2)))
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(dense_n)]
        for m in MS:
            x = (torch.randn(m, k, device="cuda") * 2).to(torch.bfloat16)
            base = decode_config(qws[0], m)
            variants = {"escha": base}
            ablations = {}  # variant name -> Ablation (measurement only: wrong results)
            if args.ablate:
                ablations = {"codec_only": Ablation.CODEC_ONLY, "loads_only": Ablation.LOADS_ONLY}
                variants.update({key: base for key in ablations})
                variants["triton_codec"] = replace(base, codec=CodecPath.TRITON)
            if args.final:
                variants["bn128_w8_s1"] = replace(base, block_n=128, num_warps=8, num_stages=1,
                                                  fuse_output=base.split == 1)
                variants["bn64_s2"] = replace(base, num_stages=2)
            if args.sweep and m in (8, 64):
                for nw in (4, 8):
                    for bkt in (4, 8):
                        for st in (1, 2):
                            key = f"w{nw}_kt{bkt}_s{st}"
                            variants[key] = replace(base, num_warps=nw, block_kt=bkt, num_stages=st)
                variants["bn64"] = replace(base, block_n=64, fuse_output=False)
                variants["split_x2"] = replace(base, split=base.split * 2, fuse_output=False)
                if base.split > 1:
                    variants["split_half"] = replace(base, split=base.split // 2, fuse_output=base.split // 2 == 1)
                variants["unfused_out"] = replace(base, fuse_output=False)
            err = gate(qws[0], m, base)
            arms = {}
            for key, cfg in variants.items():
                try:
                    ab = ablations.get(key, Ablation.NONE)
                    arms[key] = (graph_of(lambda q, c=cfg, a=ab: decode_ablated(x, q, c, a), qws), len(qws))
                except Exception as e:  # a variant that fails to compile is reported, not fatal
                    print(f"variant {key} failed: {type(e).__name__}: {str(e)[:200]}")
            arms["cublas_bf16"] = (graph_of(lambda w: torch.matmul(x, w.t()), dense), len(dense))
            t = interleaved(arms, args.rounds)
            for key, us in t.items():
                config = {a: str(b) for a, b in asdict(variants[key]).items()} if key in variants else None
                rows.append({"shape": name, "N": n, "K": k, "M": m, "arm": key, "us": us, "config": config,
                             "ablation": ablations[key].name if key in ablations else None})
            kern = decode_kernel_handle(x, qws[0], base)
            c = sass_census(kern, base)
            if m == 8:
                with open(f"{args.out}/decode_{name}_M8.sass", "w") as f:
                    f.write(kern.asm["sass"])
            floor_us = n * k * c["int_ops_per_weight"] / (64 * sms * clock_ghz * 1e3)
            c["floor_us"] = floor_us
            c["share_of_floor"] = floor_us / t["escha"]
            census[f"{name}_M{m}"] = c
            print(f"{name:8s} M={m:2d} gate={err:.2e} escha={t['escha']:7.1f} cublas={t['cublas_bf16']:6.1f} "
                  f"ratio={t['escha'] / t['cublas_bf16']:.3f} split={base.split} int/w={c['int_ops_per_weight']:.2f} "
                  f"floor={floor_us:.1f} share={c['share_of_floor']:.2f} regs={c['registers']} "
                  + " ".join(f"{kk}={v:.1f}" for kk, v in t.items() if kk not in ("escha", "cublas_bf16")), flush=True)
        del qws, dense
        torch.cuda.empty_cache()
    with open(f"{args.out}/decode_h200.json", "w") as f:
        json.dump({"env": info, "rows": rows, "census": census}, f, indent=1)
    print("\n| shape | M | escha us | cuBLAS bf16 us | ratio | share of int floor |")
    print("|---|---|---|---|---|---|")
    for name in SHAPES:
        for m in MS:
            e = next(r["us"] for r in rows if r["shape"] == name and r["M"] == m and r["arm"] == "escha")
            cb = next(r["us"] for r in rows if r["shape"] == name and r["M"] == m and r["arm"] == "cublas_bf16")
            print(f"| {name} | {m} | {e:.1f} | {cb:.1f} | {e / cb:.3f} | {census[f'{name}_M{m}']['share_of_floor']:.2f} |")


if __name__ == "__main__":
    main()
