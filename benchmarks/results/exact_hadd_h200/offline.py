"""Offline compile facts behind docs/KERNELS.md's "The codec's pipes" (sm_90a, no GPU; run from the
repository root after ``../shift_state_h200/make_prev.sh 11b05e7``):

- the loop census (ALU-pipe and FMA-pipe instructions a step) of the two-fragment 16-token build
  capped at 128 registers, with the exact codec's prmt sum (11b05e7) and its add.f16 sum (this tree);
- registers, shared memory and programs an SM of the register-operand GEMM's one-fragment builds,
  uncapped and at the caps the rule considers, for M other (``res``) and M a multiple of 16 or 1
  (``spec``);
- the same for the fp8 decode GEMM's builds with the add.f16 sum (a copy of decode_fp8.py whose
  codec imports are switched), at their own caps and at 128.

    python benchmarks/results/exact_hadd_h200/offline.py > benchmarks/results/exact_hadd_h200/offline/offline.txt
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from bench_decode import compile_in_child, loop_census  # noqa: E402

ALU = ("LOP3", "PRMT", "SHF", "ISETP", "LEA", "IADD3", "SEL", "VIADD")
FMA = ("IMAD", "HADD2", "HFMA2", "HMUL2")

_SRC = r'''
import importlib.util, json, os, sys
import triton
from triton.backends.compiler import GPUTarget
from escha.kernels.compile_check import programs_per_sm, res_usage
target = GPUTarget("cuda", 90, 32)
root = sys.argv[1]

def load(name, path, text=None):
    if text is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.path.basename(path))
        open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod

import escha.kernels.decode_wgmma  # noqa: F401
now = sys.modules["escha.kernels.decode_wgmma"]
before = load("escha.kernels._decode_wgmma_11b05e7", os.path.join(root, ".prev", "decode_wgmma_11b05e7.py"))
out = {"census": {}, "wgmma": {}, "fp8": {}}
for label, mod in (("prmt sum (11b05e7)", before), ("add.f16 sum (this tree)", now)):
    k = triton.compile(mod.gemm_source(2, 16, 3, 2), target=target,
                       options={"num_warps": 4, "launch_pdl": True, "maxnreg": 128})
    out["census"][label] = k.asm["sass"]
for bits, bn, stages, halves in ((2, 16, 3, False), (2, 32, 3, False), (2, 64, 2, False), (3, 16, 3, False)):
    for cap in (None, 96, 128):
        for build in ("res", "spec"):
            kw = {"multiples_of_16": ("M", "Np")} if build == "spec" else {}
            k = triton.compile(now.gemm_source(bits, bn, stages, 1, halves=halves, **kw), target=target,
                               options={"num_warps": 4, "launch_pdl": True, **({"maxnreg": cap} if cap else {})})
            r = res_usage(k.asm["cubin"])
            out["wgmma"][f"K={bits} {bn} tokens, cap {cap}, {build}"] = [
                r["REG"], k.metadata.shared, programs_per_sm(r["REG"], k.metadata.shared), r.get("STACK", 0)]
text = open(os.path.join(root, "escha", "kernels", "decode_fp8.py")).read()
text = text.replace("_pair_values_f16x2", "_pair_values").replace("_state_values_f16x2", "_state_values")
fp8 = load("escha.kernels._decode_fp8_addf16", "decode_fp8_addf16.py", text)
for bits in (2, 3):
    for bn in sorted(fp8.BUILDS):
        for cap in ("rule", 128):
            opts = fp8.compile_options(bn)
            if cap != "rule":
                opts["maxnreg"] = cap
            k = triton.compile(fp8.gemm_source(bits, bn), target=target, options=opts)
            r = res_usage(k.asm["cubin"])
            threads = 32 * fp8.BUILDS[bn][1] * fp8.BUILDS[bn][2]
            out["fp8"][f"K={bits} {bn} tokens, cap {cap}"] = [
                r["REG"], k.metadata.shared, programs_per_sm(r["REG"], k.metadata.shared, threads), r.get("STACK", 0),
                fp8.PROGRAMS_PER_SM[bn]]
json.dump(out, sys.stdout)
'''


def main() -> None:
    out = compile_in_child(_SRC, ROOT, args=(ROOT,), what="the builds")
    print("# Loop census, K=2, 16 tokens, two fragments, capped at 128 registers (instructions a step)")
    for label, sass in out["census"].items():
        c = loop_census(sass)
        print(f"{label}: total {sum(c.values())}, ALU pipe {sum(c.get(o, 0) for o in ALU)}, "
              f"FMA pipe {sum(c.get(o, 0) for o in FMA)}; " + ", ".join(f"{k} {v}" for k, v in
                                                                     sorted(c.items(), key=lambda kv: -kv[1])[:8]))
    print("\n# Register-operand GEMM, one fragment, add.f16 sum: registers, shared bytes, programs an SM, stack")
    for k, v in out["wgmma"].items():
        print(f"{k}: " + " ".join(str(x) for x in v))
    print("\n# fp8 decode GEMM with the add.f16 sum: registers, shared bytes, programs an SM, stack; its table's")
    for k, v in out["fp8"].items():
        print(f"{k}: " + " ".join(str(x) for x in v))


if __name__ == "__main__":
    main()
