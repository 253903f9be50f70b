"""``escha bench``: argument parsing and the run entry point."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Sequence

from .arms import DEFAULT_ARMS, make_arm, parse_arms
from .method import MIN_ROUNDS
from .shapes import DEFAULT_MS, DEFAULT_SHAPES, parse_ms, parse_shapes

DEFAULT_OUT = "out/bench"
DEFAULT_REPLAYS = 3
PROG = "escha bench"
DESCRIPTION = ("Time escha's matmul against its peers on this GPU: every arm in one process, "
               "interleaved rounds, weights rotated past L2, CUDA graphs, a correctness gate "
               "before every timing sample, best config against best config.")


def _typed(fn):
    """Wrap a parser so argparse reports its ValueError message as a usage error."""
    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = fn.__name__
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bench options, shared by the ``escha bench`` subcommand and the standalone script."""
    p.add_argument("--shapes", type=_typed(parse_shapes), default=parse_shapes(",".join(DEFAULT_SHAPES)),
                   metavar="LIST", help="comma-separated shape names (gate_up, down) or NAMExNxK "
                   "(default: gate_up,down)")
    p.add_argument("--m", type=_typed(parse_ms), default=list(DEFAULT_MS), metavar="LIST",
                   help="comma-separated token counts (default: " + ",".join(map(str, DEFAULT_MS)) + ")")
    p.add_argument("--arms", type=_typed(parse_arms), default=list(DEFAULT_ARMS), metavar="LIST",
                   help="comma-separated arms: escha, escha-<path>, escha-* (every available path), "
                   "torch-bf16, torch-fp8, triton-mxfp4, gemlite-w4, gemlite-w2, gemlite-mxfp4 "
                   "(default: all)")
    p.add_argument("--out", type=Path, default=Path(DEFAULT_OUT), metavar="DIR",
                   help=f"output directory for results.json, tables.md, bench.png (default: {DEFAULT_OUT})")
    p.add_argument("--rounds", type=int, default=MIN_ROUNDS,
                   help=f"interleaved rounds; at least {MIN_ROUNDS} unless --quick (default: {MIN_ROUNDS})")
    p.add_argument("--replays", type=int, default=DEFAULT_REPLAYS,
                   help=f"graph replays per timing sample (default: {DEFAULT_REPLAYS})")
    p.add_argument("--quick", action="store_true",
                   help="allow fewer rounds (a smoke run; its numbers are not for reporting)")
    p.add_argument("--seed", type=int, default=0, help="activation seed (default: 0)")


def check_args(args: argparse.Namespace) -> str | None:
    """Constraints between options that argparse cannot express; the message, or None."""
    if args.rounds < 1:
        return f"--rounds must be >= 1, got {args.rounds}"
    if args.rounds < MIN_ROUNDS and not args.quick:
        return f"--rounds must be >= {MIN_ROUNDS} (got {args.rounds}); pass --quick for a smoke run"
    if args.replays < 1:
        return f"--replays must be >= 1, got {args.replays}"
    return None


def add_parser(subparsers: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object; it dispatches to ``run`` via ``func``."""
    p = subparsers.add_parser("bench", help="benchmark escha's matmul against peers on the GPU",
                              description=DESCRIPTION)
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; returns a process exit status
    (0 done, 2 bad arguments, 3 no CUDA device)."""
    problem = check_args(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG}: error: no CUDA device: the benchmark times GPU kernels", file=sys.stderr)
        return 3

    from . import report
    from .cuda_timing import GraphTimer, device_info
    from .harness import run_benchmark

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    info = device_info()
    print(f"{info.name}: {info.sms} SMs, L2 {info.l2_bytes / 2**20:.0f} MiB, "
          f"clock {info.clock_hz / 1e9:.2f} GHz, copy {info.copy_bw / 1e12:.2f} TB/s (read+write)")
    arms = [make_arm(n) for n in args.arms]

    from ..progress import bar

    with bar(len(args.shapes) * len(args.m), "bench", None, unit="point") as points:
        def release(rows: list, skips: list) -> None:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            # Points finished so far survive a run that is stopped part-way.
            report.write_json(out / "results.partial.json", {"rows": [report.row_to_json(r) for r in rows]})
            points.update(1)

        # Log lines go to stdout above the bar (which is on stderr, and only on a terminal).
        rows, skips = run_benchmark(args.shapes, args.m, arms, timer=GraphTimer(replays=args.replays),
                                    rounds=args.rounds, l2_bytes=info.l2_bytes, device="cuda",
                                    seed=args.seed, info=info, after_point=release,
                                    log=lambda line: points.write(line, file=sys.stdout))
    meta = report.build_meta(gpu=info.name, driver=info.driver, extra={
        "sms": info.sms, "l2_bytes": info.l2_bytes, "clock_hz": info.clock_hz,
        "copy_bw_bytes_per_s": info.copy_bw, "rounds": args.rounds, "replays": args.replays,
        "quick": bool(args.quick), "seed": args.seed, "arms": list(args.arms),
        "shapes": [{"name": s.name, "N": s.N, "K": s.K} for s in args.shapes], "ms": list(args.m),
        "argv": sys.argv[1:], "wall_s": None})
    meta["wall_s"] = round(time.time() - t0, 1)
    doc = report.results_doc(meta, rows, skips)
    problems = report.validate_results(doc)
    if problems:  # a schema break is a bug in this package, not in the measurement
        raise RuntimeError("results.json would not match its schema: " + "; ".join(problems))
    report.write_json(out / "results.json", doc)
    (out / "results.partial.json").unlink(missing_ok=True)
    text = report.render_tables(rows) + "\n" + report.render_skips(skips)
    (out / "tables.md").write_text(text)
    print(text)
    note = report.plot(rows, out / "bench.png")
    print(note or f"plot: {out / 'bench.png'}")
    print(f"results: {out / 'results.json'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Standalone entry point (benchmarks/bench_matmul.py): same options as ``escha bench``."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION)
    add_arguments(p)
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        p.error(problem)
    return run(args)
