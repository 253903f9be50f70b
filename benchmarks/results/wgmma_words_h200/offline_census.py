"""Offline sm_90a builds (no GPU) of decode_wgmma.py files given as arguments, e.g. the kernel before
and after the words moved into registers:

    git show fbbed39:escha/kernels/decode_wgmma.py > /tmp/decode_wgmma_fbbed39.py
    git show ceb24b1:escha/kernels/decode_wgmma.py > /tmp/decode_wgmma_ceb24b1.py
    env -u TRITON_INTERPRET python benchmarks/results/wgmma_words_h200/offline_census.py \\
        /tmp/decode_wgmma_fbbed39.py /tmp/decode_wgmma_ceb24b1.py > .../offline_census.txt

For each file and each of its rule's variants (its own PROGRAMS_PER_SM, rule_variant and
register_cap): registers, stack, shared memory, the programs an SM holds, the PTX's bar.sync and
16-byte global and shared loads; then the 64-token build's loop by SASS opcode (cuobjdump, the
instructions between the loop's back edge and its head, the tile-end store included).
"""
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
import escha.kernels  # noqa: E402,F401  (the files' relative imports resolve against today's package)

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def load(path):
    name = "escha.kernels._" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def cuobjdump(cubin: bytes, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, flag, f.name], capture_output=True, text=True, check=True).stdout


def loop_ops(sass: str) -> collections.Counter:
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s*/\*([0-9a-f]{4})\*/\s*(.*?);", line)] if m]
    back = [(a, int(m.group(1), 16)) for a, t in ins for m in [re.search(r"BRA (?:U?!?P\d, )?0x([0-9a-f]+)", t)]
            if m and int(m.group(1), 16) < a]
    end, head = max(back, key=lambda x: x[0] - x[1])
    return collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                               for a, t in ins if head <= a <= end)


def main() -> int:
    target = GPUTarget("cuda", 90, 32)
    for path in sys.argv[1:]:
        dw = load(path)
        print(f"# {os.path.basename(path)}")
        for bits, bn in sorted(dw.PROGRAMS_PER_SM):
            _, frags, stages, halves = dw.rule_variant(bn, bits)
            cap = dw.register_cap(bits, bn)
            opts = {"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})}
            k = triton.compile(dw.gemm_source(bits, bn, stages, frags, halves=halves), target=target, options=opts)
            res = cuobjdump(k.asm["cubin"], "-res-usage")
            regs = int(re.search(r"\bREG:(\d+)", res).group(1))
            stack = int(re.search(r"STACK:(\d+)", res).group(1))
            fits = min(65536 // (128 * (-(-regs // 8) * 8)), 233472 // (k.metadata.shared + 1024))
            ptx = k.asm["ptx"]
            print(f"K={bits} tokens={bn} fragments={frags} stages={stages} halves={int(halves)} cap={cap}: "
                  f"registers {regs}, stack {stack}, shared {k.metadata.shared}, programs an SM {fits} "
                  f"(table {dw.PROGRAMS_PER_SM[(bits, bn)]}), bar.sync {ptx.count('bar.sync')}, "
                  f"16-byte global loads {len(re.findall(r'ld.global[^;]*v4', ptx))}, "
                  f"16-byte shared loads {len(re.findall(r'ld.shared[^;]*v4', ptx))}", flush=True)
            if (bits, bn) == (2, 64):
                ops = loop_ops(cuobjdump(k.asm["cubin"], "-sass"))
                print(f"  64-token loop: {sum(ops.values())} instructions: "
                      + ", ".join(f"{op} {n}" for op, n in ops.most_common()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
