"""sm_90a builds of the fp8 decode GEMM (no GPU): registers, stack, shared memory, programs an SM
against PROGRAMS_PER_SM, the partials' stores in PTX and SASS, SASS length.
    python offline_compile.py new                 # the checkout's decode_fp8.py (the patch applied)
    python offline_compile.py old FILE            # an earlier decode_fp8.py (git show REV:...)"""
import sys, re, importlib.util
import triton
from triton.backends.compiler import GPUTarget
which = sys.argv[1]
if which == "old":
    spec = importlib.util.spec_from_file_location("escha.kernels._old_fp8", sys.argv[2])
    df = importlib.util.module_from_spec(spec); sys.modules[spec.name] = df; spec.loader.exec_module(df)
else:
    import escha.kernels.decode_fp8; df = sys.modules["escha.kernels.decode_fp8"]
from escha.kernels.compile_check import res_usage, cuobjdump, programs_per_sm
for bn in sorted(df.BUILDS):
    for bits in (2, 3):
        k = triton.compile(df.gemm_source(bits, bn), target=GPUTarget("cuda", 90, 32), options=df.compile_options(bn))
        ptx = k.asm["ptx"]; cubin = k.asm["cubin"]
        u = res_usage(cubin)
        _, wm, wn, _ = df.BUILDS[bn]
        sass = cuobjdump(cubin, "-sass")
        stores = re.findall(r"\bst\.global[\.\w]*", ptx)
        sst = re.findall(r"\bSTG\.E[\.\w]*", sass)
        print(which, f"K={bits} bn={bn}", "regs", u["REG"], "stack", u["STACK"], "shared", k.metadata.shared,
              "fits", programs_per_sm(u["REG"], k.metadata.shared, threads=32*wm*wn), "table", df.PROGRAMS_PER_SM[bn],
              "ptx stores", {s: stores.count(s) for s in set(stores)}, "sass STG", {s: sst.count(s) for s in set(sst)},
              "cvt bf16", len(re.findall(r"cvt\.rn\.bf16", ptx)), "sass instr", len(re.findall(r"^\s+/\*[0-9a-f]{4}\*/", sass, re.M)))
