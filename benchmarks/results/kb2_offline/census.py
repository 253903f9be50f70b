"""Offline census (no GPU) of the two-k-blocks-a-stage candidate: the steady-state loop of the
register-operand decode GEMM a k-block (the tile-end store left out), for builds given as
BITS,TOKENS,STAGES,FRAGMENTS,HALVES,KBLOCKS_PER_STAGE. Run on a checkout with candidate.patch
applied (ROOT, default the repository this file is in):

    git apply benchmarks/results/kb2_offline/candidate.patch
    env -u TRITON_INTERPRET python benchmarks/results/kb2_offline/census.py 2,8,3,1,1,1 2,8,2,1,1,2 \
        2,16,3,2,0,1 2,16,2,2,0,2 3,8,3,1,1,1 3,8,2,1,1,2 > benchmarks/results/kb2_offline/census.txt
"""
import sys, os, subprocess, tempfile, re
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, os.environ.get("ROOT", os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))))
import escha.kernels.decode_wgmma
dw = sys.modules["escha.kernels.decode_wgmma"]
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for spec in sys.argv[1:]:
    bits, bn, stages, frags, halves, kb = [int(v) for v in spec.split(",")]
    kw = {"kblocks_per_stage": kb} if kb != 1 else {}
    k = triton.compile(dw.gemm_source(bits, bn, stages, frags, halves=bool(halves), **kw), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"\bREG:(\d+)", res).group(1))
    fits = min(65536 // (128 * (-(-regs // 8) * 8)), 233472 // (k.metadata.shared + 1024))
    ins = [(int(m.group(1), 16), m.group(2).strip()) for l in sass.splitlines() for m in [re.match(r"\s*/\*([0-9a-f]{4})\*/\s*(.*?);", l)] if m]
    back = [(a, int(mm.group(1), 16)) for a, t in ins for mm in [re.search(r"BRA (?:U?!?P\d, )?0x([0-9a-f]+)", t)] if mm and int(mm.group(1), 16) < a]
    a, tgt = max(back, key=lambda x: x[0] - x[1])
    body = [(ad, t) for ad, t in ins if tgt <= ad <= a]
    # the forward branch around the store: the first forward BRA whose target lies in the body and skips > 40 instructions
    skip = [(ad, int(mm.group(1), 16)) for ad, t in body for mm in [re.search(r"BRA (?:U?!?P\d, )?0x([0-9a-f]+)", t)] if mm and int(mm.group(1), 16) > ad + 40 * 16 and int(mm.group(1), 16) <= a]
    s0, s1 = skip[0]
    steady = [t for ad, t in body if not (s0 < ad < s1)]
    # the mbarrier wait's retry branch lies outside the body; count it once
    print(spec, "registers", regs, "shared", k.metadata.shared, "programs an SM", fits, "loop", len(body), "store block", len([1 for ad, t in body if s0 < ad < s1]), "steady", len(steady), "per k-block", len(steady) / kb, flush=True)
