"""Offline facts of the bf16 pair partials (sm_90a, no GPU): the fp8 GEMM's builds against the
previous tree's copy (.prev/decode_fp8_base.py, ``benchmarks/snapshot_kernels.sh base REV``) and
the two-16-bit-store form (.prev/decode_fp8_b16.py, ``make_b16.py``), if made,
and the output transform's loads for fp32 partials and for pair words. Counts, not timings.
Usage (repository root): python benchmarks/results/fp8_bf16_pairs/offline.py > offline.txt"""
import importlib
import os
import re
import sys
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from escha.kernels.compile_check import cuobjdump, res_usage

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from bench_decode import load_previous  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
ST_PTX, ST_SASS, LD_PTX = r"st\.global[.\w]*", r"STG[.\w]*", r"ld\.global[.\w]*"
new = importlib.import_module("escha.kernels.decode_fp8")
transforms = importlib.import_module("escha.kernels.transforms")
arms = [("base", load_previous(".prev/decode_fp8_base.py")), ("pairs", new)]
if os.path.exists(".prev/decode_fp8_b16.py"):  # make_b16.py: the pairs by two 16-bit stores
    arms.append(("b16", load_previous(".prev/decode_fp8_b16.py")))


print(f"triton {triton.__version__}, sm_90a")
print("fp8 GEMM (K=2): registers, stack bytes, PTX global stores, SASS STG, SASS instructions")
for bn in sorted(new.BUILDS):
    for label, mod in arms:
        k = triton.compile(mod.gemm_source(2, bn), target=TARGET, options=mod.compile_options(bn))
        s = cuobjdump(k.asm["cubin"], "-sass")
        instr = len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", s, re.M))
        stores = dict(Counter(re.findall(ST_PTX, k.asm["ptx"])))
        stg = dict(Counter(re.findall(ST_SASS, s)))
        use = res_usage(k.asm["cubin"])
        print(f"  {bn:3d} tokens {label:5s}: regs {use['REG']}, stack {use['STACK']}, {stores}, {stg}, "
              f"{instr} instructions")

print("output transform (16 tokens a program, 2 partials, 4 warps): PTX global loads, shared stores, lines")
fn = transforms._output_transform_kernel
for label, zdt in (("fp32 rows", "*fp32"), ("pair words", "*i32")):
    sig = {a: "i32" for a in fn.arg_names}
    sig.update(z_ptr=zdt, y_ptr="*bf16", hw_ptr="*bf16", scale_ptr="*fp32", su_ptr="*fp32", gscale_ptr="*fp32",
               inv_ptr="*fp32", hb_ptr="*i32", seg_ptr="*i32", heps="fp32")
    consts = {"SPLIT": 2, "BM": 16, "PDL": True, "HEAD_NORM": False, "PAIRED": zdt == "*i32"}
    sig.update({c: "constexpr" for c in consts})
    aligned = ["z_ptr", "y_ptr", "scale_ptr", "su_ptr", "gscale_ptr", "inv_ptr", "hw_ptr", "hb_ptr", "seg_ptr",
               "stride_zs", "stride_zm", "stride_ym"]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=TARGET,
                       options={"num_warps": 4, "launch_pdl": True})
    ptx = k.asm["ptx"]
    loads = dict(Counter(re.findall(LD_PTX, ptx)))
    print(f"  {label:10s}: {loads}, st.shared {ptx.count('st.shared')}, {ptx.count(chr(10))} lines")
