"""The fuzz test's accuracy gate (tests/test_fuzz.py ``check_case``) against wrong outputs, on the CPU.

For random cases of the CPU-runnable paths (reference, the portable decode kernel and the prefill
and dequantize-once kernels, in Triton's interpreter) it reports
1. how much error each gate allows, as a multiple of ||y||: the current one,
   tol x max(||y||, few(n) ||q||), and the one before it, which also accepted
   err <= U ||(|r| |Hn| |T| |x'|)|| + 2 u_out ||y|| (the componentwise worst case, taken normwise);
2. how many cases each gate lets through when escha.matmul's output is replaced by zeros, its
   negation, 1.3 times it, or with its last row zeroed (and the real output, which must pass).

    python benchmarks/fuzz_gate.py [--cases 25] [--out benchmarks/results/fuzz_gate]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import escha  # noqa: E402
import test_fuzz as tf  # noqa: E402
from escha.bench.report import git_sha  # noqa: E402
from escha.format import decode_trellis, input_transform, random_qweight, row_scale  # noqa: E402
from escha.format.spec import HAD_BLOCK  # noqa: E402
from escha.ops import KernelPath, resolve_path  # noqa: E402

PATHS = [None, "reference", "prefill", "dequant-fp8", "dequant-core-fp8", "dequant-bf16", "dequant-core-bf16"]
# The earlier gate's worst-case operand rounding per path (tests/test_fuzz.py before this form).
U_OLD = {KernelPath.REFERENCE: 0.0, KernelPath.DECODE: 2**-10, KernelPath.DECODE_WGMMA: 2**-10,
         KernelPath.DEQUANT_BF16: 2**-7 + 2**-8, KernelPath.PREFILL: 2**-3 + 2**-7, KernelPath.DEQUANT_FP8: 2**-3 + 2**-7,
         KernelPath.DEQUANT_CORE_FP8: 2**-3 + 2**-7, KernelPath.DEQUANT_CORE_BF16: 2**-6, KernelPath.DECODE_FP8: 2**-3 + 2**-7}
OUT_U = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24}
MUTATIONS = {"real": lambda y: y, "zeros": torch.zeros_like, "negated": lambda y: -y, "x1.3": lambda y: 1.3 * y,
             "last row zeroed": lambda y: torch.cat([y[:-1], 0 * y[-1:]])}


def magnitude(x: torch.Tensor, qw) -> torch.Tensor:
    """|r| |Hn| |T| |x'|: the earlier gate's sum of absolute product terms (float64)."""
    xp = input_transform(x.double(), qw).double().abs()
    z = xp @ decode_trellis(qw).double().abs().T
    zb = z.unflatten(-1, (-1, HAD_BLOCK)).sum(-1, keepdim=True).expand(-1, -1, HAD_BLOCK).flatten(-2)
    return (zb / HAD_BLOCK ** 0.5 * row_scale(qw).double().abs())[:, : qw.out_features]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=25)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "fuzz_gate"))
    args = ap.parse_args()
    rng = random.Random(5)
    cases = [(rng.choice([1, 3, 17, 64, 130, 257, 600]), rng.choice([1, 5, 128, 300, 600]), rng.choice([1, 2, 7, 24]),
              rng.choice([torch.float16, torch.bfloat16, torch.float32]), rng.choice([2, 3]), rng.choice(PATHS),
              rng.randint(0, 2**20)) for _ in range(args.cases)]
    rows, passed = [], {name: {"new": 0, "old": 0} for name in MUTATIONS}
    for out, inp, m, dtype, bits, path, seed in cases:
        qw = random_qweight(out, inp, bits, seed=seed)
        x = torch.randn(m, inp, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(dtype)
        y, ran = escha.matmul(x, qw, path=path), resolve_path(m, qw, path)
        ref = x.double() @ escha.dequantize(qw).double().T
        yn, qn = float(ref.norm()), float(tf.quadrature(x, qw).norm())
        tol = max(tf.TOL[ran], 2e-3 if dtype == torch.float16 else 1e-2 if dtype == torch.bfloat16 else 0)
        new = tol * max(yn, tf.few(ref.numel()) * qn)
        old_bound = U_OLD[ran] * float(magnitude(x, qw).norm()) + 2 * OUT_U[dtype] * yn
        rows.append({"path": ran.value, "shape": [out, inp], "M": m, "dtype": str(dtype), "bits": bits,
                     "allowed_new_over_y": new / yn, "allowed_old_over_y": max(tol * yn, old_bound) / yn,
                     "real_err_over_new": float((y.double() - ref).norm()) / new})
        for name, mutate in MUTATIONS.items():
            err = float((mutate(y).double() - ref).norm())
            passed[name]["new"] += err <= new
            passed[name]["old"] += err <= tol * yn or err <= old_bound
    by_path: dict[str, list] = {}
    for r in rows:
        by_path.setdefault(r["path"], []).append(r)
    lines = [f"# The fuzz gate against wrong outputs ({args.cases} random CPU cases, git {git_sha()}, "
             f"torch {torch.__version__})", "",
             "| path | cases | allowed / norm(y), current gate | allowed / norm(y), earlier gate | real error / allowed (max) |",
             "|---|---|---|---|---|"]
    for p, rs in sorted(by_path.items()):
        lines.append(f"| {p} | {len(rs)} | {min(r['allowed_new_over_y'] for r in rs):.3g}-"
                     f"{max(r['allowed_new_over_y'] for r in rs):.3g} | {min(r['allowed_old_over_y'] for r in rs):.3g}-"
                     f"{max(r['allowed_old_over_y'] for r in rs):.3g} | {max(r['real_err_over_new'] for r in rs):.2f} |")
    lines += ["", "| output | passed, current gate | passed, earlier gate |", "|---|---|---|"]
    lines += [f"| {name} | {v['new']} / {args.cases} | {v['old']} / {args.cases} |" for name, v in passed.items()]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "fuzz_gate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "fuzz_gate.json"), "w") as f:
        json.dump({"git": git_sha(), "torch": torch.__version__, "cases": rows, "passed": passed}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
