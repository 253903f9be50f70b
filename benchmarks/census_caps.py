"""The register-operand decode GEMM's builds under ptxas register caps, compiled for sm_90a here
(no GPU; builds, not timings): what ``bench_decode_wgmma.py --cap-variants`` times (CAP_ARMS).
Each build as launches specialize it: the weight's padded rows (Np) a multiple of 16 (every shape),
and the tokens M not a multiple of 16 or, in the blocks of 16-64 tokens, a multiple of 16 (16, 32,
48, 64), and in the 8-token block M = 1 (Triton makes it a constant): each is another kernel,
which ptxas may schedule otherwise.

For each variant of the rule (``decode_wgmma.rule_variant``, K = 2 and 3, 8-64 tokens), the build
without a cap and with caps from the most registers its programs an SM allow down in steps of 8
(and every build of CAP_ARMS): registers, stack (spills), shared memory,
programs an SM (``compile_check.programs_per_sm``), the steady loop's instructions
(``bench_decode.steady_loop``) and the sum of their control codes' stall counts (bits 41-44 of
each instruction's second 64-bit word: the cycles the scheduler waits before that warp's next
instruction, which ptxas sets; a latency-bound loop pays them where no other warp issues). Also
the fp8 decode GEMM's 128-token build with its cap of 168 and without (``caps_fp8.json``), which
``bench_decode_fp8.py --uncapped`` times.

    python benchmarks/census_caps.py [--out benchmarks/results/caps_offline]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import compile_in_child, loop_region, sass_instructions, steady_loop_span  # noqa: E402
from bench_decode_wgmma import CAP_ARMS  # noqa: E402

from escha.kernels.decode_wgmma import PROGRAMS_PER_SM, register_cap, rule_variant  # noqa: E402

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.compile_check import cuobjdump, programs_per_sm, res_usage
from escha.kernels.decode_wgmma import gemm_source

target = GPUTarget("cuda", 90, 32)
out = []
for (bits, bn, stages, frags, halves, cap), m in [(b, m) for b in json.loads(sys.argv[1])
                                                 for m in (("other", "1") if b[1] == 8 else ("other", "16k"))]:
    opts = {"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})}
    src = gemm_source(bits, bn, stages, frags, halves=halves, multiples_of_16=("M", "Np") if m == "16k" else ("Np",),
                      one_token=m == "1")
    k = triton.compile(src, target=target, options=opts)
    r = res_usage(k.asm["cubin"])
    out.append({"bits": bits, "tokens": bn, "m": m, "stages": stages, "fragments": frags,
                "halves": halves, "cap": cap,
                "registers": r["REG"], "stack": r["STACK"], "shared": k.metadata.shared,
                "programs_per_sm": programs_per_sm(r["REG"], k.metadata.shared),
                "sass": cuobjdump(k.asm["cubin"], "-sass")})
json.dump(out, sys.stdout)
"""


# The fp8 decode GEMM's 128-token build (decode_fp8.BUILDS: capped at 168) with and without its cap,
# the weight's padded rows a multiple of 16 as every shape's launch has them.
_COMPILE_FP8 = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.compile_check import programs_per_sm, res_usage
from escha.kernels.decode_fp8 import BUILDS, compile_options, gemm_source

out = []
for bits in (2, 3):
    for cap in (BUILDS[128][3], None):
        src = gemm_source(bits, 128)
        src.attrs = {**src.attrs, (list(src.signature).index("Np"),): [["tt.divisibility", 16]]}
        opts = {**compile_options(128), "maxnreg": cap}
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={o: v for o, v in opts.items() if v})
        r = res_usage(k.asm["cubin"])
        out.append({"bits": bits, "tokens": 128, "cap": cap, "registers": r["REG"], "stack": r["STACK"],
                    "programs_per_sm": programs_per_sm(r["REG"], k.metadata.shared, 32 * opts["num_warps"]),
                    "sass": k.asm["sass"]})
print(json.dumps(out))
"""


M_LABELS = {"other": "other", "16k": "a multiple of 16", "1": "1 (a constant)"}


def control_stalls(sass: str) -> list[int]:
    """The stall count of each instruction of a SASS listing, in the order of ``sass_instructions``
    (either style it reads): in ``cuobjdump -sass``'s, bits 41-44 of the second word of the
    instruction's 128-bit encoding (the next line); in the Triton handle's ``asm["sass"]``, the last
    field of the control prefix (``--:-:-:Y:4``, hexadecimal)."""
    lines = sass.splitlines()
    out = []
    for i, ln in enumerate(lines):
        if re.match(r"^\s*/\*[0-9a-f]+\*/\s+.*?;", ln):
            hi = int(re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1]).group(1), 16)
            out.append((hi >> 41) & 0xF)
        else:
            m = re.match(r"^\s*[-\w]+:[-\w]+:[-\w]+:[-\w]+:(\w+)\s+.*?;", ln)
            if m:
                out.append(int(m.group(1), 16))
    return out


def loop_stalls(sass: str) -> tuple[int, int]:
    """(instructions, summed stall counts) of the steady loop (``steady_loop``)."""
    first, s0, s1, last = steady_loop_span(sass)
    stalls = control_stalls(sass)
    assert len(stalls) == len(sass_instructions(sass)[0])
    return s0 + 1 - first + last + 1 - s1, sum(stalls[first:s0 + 1]) + sum(stalls[s1:last + 1])


#: Caps earlier runs timed outside the steps of 8 (docs/KERNELS.md, "The cap is the rule's now").
EARLIER_CAPS = {(3, 64): (168,)}


def builds() -> list[tuple]:
    """(K, tokens, stages, fragments, halves, cap) of every build the census compiles."""
    out = []
    for (bits, bn), per_sm in sorted(PROGRAMS_PER_SM.items()):
        if bn > 64:
            continue
        _, frags, stages, halves = rule_variant(bn, bits)
        most = 65536 // (128 * per_sm) // 8 * 8  # the most registers that keep the rule's programs an SM
        caps = {None, register_cap(bits, bn), *EARLIER_CAPS.get((bits, bn), ())} | set(range(most, most - 41, -8))
        out += [(bits, bn, stages, frags, halves, c) for c in sorted(caps, key=lambda c: -(c or 999))]
        for _, changes, _ in CAP_ARMS.get((bits, bn), []):
            build = (bits, bn, changes.get("stages", stages), frags, halves, changes["max_registers"])
            if build not in out:
                out.append(build)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "caps_offline"))
    args = ap.parse_args()
    rows = compile_in_child(_COMPILE, ROOT, (json.dumps(builds()),), what="the capped builds")
    for r in rows:
        r["loop_instructions"], r["loop_stall_cycles"] = loop_stalls(r.pop("sass"))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "caps.json"), "w") as f:
        json.dump(rows, f, indent=1)
    arms = {(b, n, ch.get("stages", rule_variant(n, b)[2]), ch["max_registers"]): label
            for (b, n), arm_list in CAP_ARMS.items() for label, ch, _ in arm_list}
    lines = ["| K | tokens | M | fragments | halves | stages | cap | registers | stack (bytes) | "
             "shared (bytes) | programs an SM | loop instructions | loop stall cycles | arm |", "|" + "---|" * 14]
    for r in rows:
        key = (r["bits"], r["tokens"], r["stages"], r["cap"])
        rule = (r["cap"] == register_cap(r["bits"], r["tokens"])
                and r["stages"] == rule_variant(r["tokens"], r["bits"])[2])
        arm = "rule" if rule else arms.get(key, "")
        lines.append(f"| {r['bits']} | {r['tokens']} | {M_LABELS[r['m']]} | {r['fragments']} | {r['halves']} | "
                     f"{r['stages']} | {r['cap'] or '-'} | {r['registers']} | {r['stack']} | {r['shared']} | "
                     f"{r['programs_per_sm']} | {r['loop_instructions']} | {r['loop_stall_cycles']} | {arm} |")
    fp8 = compile_in_child(_COMPILE_FP8, ROOT, what="the fp8 128-token builds")
    for r in fp8:
        sass = r.pop("sass")
        instrs, _, first, last = loop_region(sass, containing="QGMMA")
        stalls = control_stalls(sass)
        assert len(stalls) == len(instrs)
        r["loop_instructions"], r["loop_stall_cycles"] = last + 1 - first, sum(stalls[first:last + 1])
    with open(os.path.join(args.out, "caps_fp8.json"), "w") as f:
        json.dump(fp8, f, indent=1)
    fp8_lines = ["| K | tokens | cap | registers | stack (bytes) | programs an SM | step-loop instructions | "
                 "step-loop stall cycles |", "|" + "---|" * 8]
    fp8_lines += [f"| {r['bits']} | {r['tokens']} | {r['cap'] or '-'} | {r['registers']} | {r['stack']} | "
                  f"{r['programs_per_sm']} | {r['loop_instructions']} | {r['loop_stall_cycles']} |" for r in fp8]
    with open(os.path.join(args.out, "caps.md"), "w") as f:
        f.write("# The decode GEMM's builds under register caps (sm_90a, offline)\n\n"
                "`benchmarks/census_caps.py`; \"arm\": the rule's build, or the label of "
                "`bench_decode_wgmma.py --cap-variants` that times it (CAP_ARMS).\n\n" + "\n".join(lines) + "\n"
                "\n## The fp8 decode GEMM's 128-token build, with its cap of 168 and without\n\n"
                "The step loop: the innermost loop around its QGMMA (`bench_decode.loop_region`).\n\n"
                + "\n".join(fp8_lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
