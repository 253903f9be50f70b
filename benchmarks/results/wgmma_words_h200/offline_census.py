"""Offline sm_90a builds (no GPU) of decode_wgmma.py files given as arguments, e.g. the kernel before
and after the words moved into registers:

    git show fbbed39:escha/kernels/decode_wgmma.py > /tmp/decode_wgmma_fbbed39.py
    git show ceb24b1:escha/kernels/decode_wgmma.py > /tmp/decode_wgmma_ceb24b1.py
    env -u TRITON_INTERPRET python benchmarks/results/wgmma_words_h200/offline_census.py \\
        /tmp/decode_wgmma_fbbed39.py /tmp/decode_wgmma_ceb24b1.py > .../offline_census.txt

For each file and each of its rule's variants (its own PROGRAMS_PER_SM, rule_variant and
register_cap): registers, stack, shared memory, the programs an SM holds, the PTX's bar.sync and
16-byte global and shared loads; then the 64-token build's loop by SASS opcode
(``bench_decode.loop_census``: the longest region a backward branch closes, the tile-end store
included).
"""
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]
from bench_decode import load_previous, loop_census, programs_per_sm, res_usage  # noqa: E402


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for path in sys.argv[1:]:
        dw = load_previous(path)  # the file's relative imports resolve against today's package
        print(f"# {os.path.basename(path)}")
        for bits, bn in sorted(dw.PROGRAMS_PER_SM):
            _, frags, stages, halves = dw.rule_variant(bn, bits)
            cap = dw.register_cap(bits, bn)
            opts = {"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})}
            k = triton.compile(dw.gemm_source(bits, bn, stages, frags, halves=halves), target=target, options=opts)
            res = res_usage(k.asm["cubin"])
            fits = programs_per_sm(res["REG"], k.metadata.shared)
            ptx = k.asm["ptx"]
            print(f"K={bits} tokens={bn} fragments={frags} stages={stages} halves={int(halves)} cap={cap}: "
                  f"registers {res['REG']}, stack {res['STACK']}, shared {k.metadata.shared}, programs an SM {fits} "
                  f"(table {dw.PROGRAMS_PER_SM[(bits, bn)]}), bar.sync {ptx.count('bar.sync')}, "
                  f"16-byte global loads {len(re.findall(r'ld.global[^;]*v4', ptx))}, "
                  f"16-byte shared loads {len(re.findall(r'ld.shared[^;]*v4', ptx))}", flush=True)
            if (bits, bn) == (2, 64):
                ops = sorted(loop_census(k.asm["sass"]).items(), key=lambda kv: -kv[1])
                print(f"  64-token loop: {sum(n for _, n in ops)} instructions: "
                      + ", ".join(f"{op} {n}" for op, n in ops), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
