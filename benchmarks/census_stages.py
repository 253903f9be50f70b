"""The register-operand decode GEMM's rule builds with deeper TMA rings, compiled for sm_90a here
(no GPU; builds, not timings): for each token block of the rule (``decode_wgmma.rule_variant``, K =
2 and 3, 8-64 tokens) and rings of its own stages up to three more, the registers, stack, shared
memory, programs an SM (``compile_check.programs_per_sm``) and the steady loop's instructions
(``bench_decode.steady_loop``), each build as launches specialize it (M a multiple of 16 or not,
as ``census_caps.py``). Which deeper rings keep the rule's programs an SM is what
``bench_decode_wgmma.py --stage-variants`` times (STAGE_ARMS).

    python benchmarks/census_stages.py > benchmarks/results/stages_offline/stages.txt
"""
from __future__ import annotations

import datetime
import os
import sys

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import steady_loop  # noqa: E402

from escha.bench.report import git_sha  # noqa: E402
from escha.kernels.compile_check import programs_per_sm, res_usage  # noqa: E402
from escha.kernels.decode_wgmma import gemm_source, register_cap, rule_variant  # noqa: E402


def main() -> None:
    target = GPUTarget("cuda", 90, 32)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(f"triton {triton.__version__}, sm_90a, offline (no GPU); git {git_sha()}, {date}")
    print("| K | tokens | M | fragments | halves | cap | stages | registers | stack | shared | programs an SM "
          "| loop instructions |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for bits in (2, 3):
        for m in (8, 16, 32, 64):
            bn, frags, rule_stages, halves = rule_variant(m, bits)
            cap = register_cap(bits, bn)
            for stages in range(rule_stages, rule_stages + 4):
                for mult in ((("Np",), ("M", "Np")) if bn > 8 else (("Np",),)):
                    src = gemm_source(bits, bn, stages, frags, halves=halves, multiples_of_16=mult)
                    opts = {"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})}
                    k = triton.compile(src, target=target, options=opts)
                    r = res_usage(k.asm["cubin"])
                    loop, _ = steady_loop(k.asm["sass"])
                    print(f"| {bits} | {bn} | {'a multiple of 16' if 'M' in mult else 'other'} | {frags} | {halves} "
                          f"| {cap or '-'} | {stages}{' (rule)' if stages == rule_stages else ''} | {r['REG']} "
                          f"| {r['STACK']} | {k.metadata.shared} | {programs_per_sm(r['REG'], k.metadata.shared)} "
                          f"| {len(loop)} |", flush=True)


if __name__ == "__main__":
    main()
