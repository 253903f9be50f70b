"""The loader-partition candidate's sm_90a builds at each variant of the rule, register caps 48
and 64, with and without PDL: registers a thread at launch (cuobjdump), stack bytes, the
setmaxnreg values the two partitions take, and whether ptxas builds it at all. Offline (no GPU),
from a tree with candidate.patch applied:

    patch -p1 < benchmarks/results/ws_loader/candidate.patch
    python benchmarks/results/ws_loader/builds.py 2>/dev/null | grep -E "^(triton |K=)" \
        > benchmarks/results/ws_loader/builds.txt

(Triton prints a failed build's whole PTX on stdout; the grep keeps this script's lines.)
"""
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from escha.kernels.decode_wgmma import gemm_source, rule_variant

cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
print(f"triton {triton.__version__}, sm_90a")
for bits in (2, 3):
    for bn in (8, 16, 32, 64, 128):
        tokens, frags, stages, halves = rule_variant(bn, bits)
        for maxnreg in (48, 64):
            for pdl in (True, False):
                head = f"K={bits} tokens={tokens} fragments={frags} halves={halves} maxnreg={maxnreg} pdl={pdl}:"
                try:
                    k = triton.compile(gemm_source(bits, tokens, stages, frags, pdl=pdl, halves=halves, loader=True),
                                       target=GPUTarget("cuda", 90, 32),
                                       options={"num_warps": 4, "launch_pdl": pdl, "maxnreg": maxnreg})
                except Exception as e:  # ptxas's failures, as they are
                    print(head, "no build:", str(e).splitlines()[0][:80])
                    continue
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True,
                                         text=True).stdout
                regs = int(re.search(r"REG:(\d+)", res).group(1))
                stack = int(re.search(r"STACK:(\d+)", res).group(1))
                setmax = sorted({int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", k.asm["ptx"])})
                print(head, f"{regs} registers at launch ({regs * 256} a program: {65536 // (regs * 256)} an SM by"
                      f" registers), stack {stack} B, shared {k.metadata.shared} B, setmaxnreg {setmax}")
