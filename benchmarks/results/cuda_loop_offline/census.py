"""Offline census of decode_loop.cu (no GPU): compile it for sm_90a with nvcc, disassemble it with
the cuobjdump Triton bundles, and count the consumer's instructions for one k-block in steady
state: the first ring stage's part of the unrolled loop (from its mbarrier wait to the next
stage's), less the tile-end store (the block the branch after the MMAs' wait skips).

    python benchmarks/results/cuda_loop_offline/census.py > benchmarks/results/cuda_loop_offline/census.txt
"""
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "decode_loop.cubin")
        build = subprocess.run(["nvcc", "-arch=sm_90a", "-O3", "-cubin", "-Xptxas", "-v", "-o", cubin,
                                os.path.join(HERE, "decode_loop.cu")], capture_output=True, text=True, check=True)
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    print(subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
    print("\n".join(line for line in build.stderr.splitlines() if "registers" in line or "stack" in line))
    ins = [(int(m.group(1), 16), m.group(2).strip()) for line in sass.splitlines()
           for m in [re.match(r"\s*/\*([0-9a-f]{4})\*/\s*(.*?);", line)] if m]
    waits = [a for a, t in ins if "TRYWAIT" in t and "+0x60" in t]
    start, end = waits[0], waits[1]  # stage 0's wait on "full", stage 1's
    seg = [(a, t) for a, t in ins if start <= a < end]
    depbar = next(a for a, t in seg if t.startswith("WARPGROUP.DEPBAR"))
    skip = next((a, int(m.group(1), 16)) for a, t in seg if a > depbar
                for m in [re.search(r"BRA (?:U?!?P\d, )?0x([0-9a-f]+)", t)] if m)
    steady = [t for a, t in seg if not skip[0] < a < skip[1]]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in steady)
    print(f"consumer, one k-block in steady state: {len(steady)} instructions "
          f"(the stage's part of the loop {len(seg)}, tile-end store {len(seg) - len(steady)})")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
