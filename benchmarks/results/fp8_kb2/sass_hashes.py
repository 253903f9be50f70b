"""Hash of each cubin's sm_90a SASS (addresses and encodings stripped) under a compile_check cache,
counted: two trees whose lists match compiled the same machine code.

    env -u TRITON_INTERPRET TRITON_CACHE_DIR=DIR python -m escha.kernels.compile_check
    python benchmarks/results/fp8_kb2/sass_hashes.py DIR > hashes.txt
"""
import glob, hashlib, re, sys, collections
from escha.kernels.compile_check import cuobjdump
out = collections.Counter()
for f in glob.glob(sys.argv[1] + "/*/*.cubin"):
    s = cuobjdump(open(f, "rb").read(), "-sass")
    lines = []
    for l in s.splitlines():
        l = re.sub(r"/\*[0-9a-f]{4,}\*/", "", l)
        l = re.sub(r"/\* 0x[0-9a-f]+ \*/", "", l).strip()
        if l and not l.startswith(("code for", "Function", ".", "//", "--")):
            lines.append(l)
    name = f.split("/")[-1]
    out[(name, hashlib.md5("\n".join(lines).encode()).hexdigest()[:12])] += 1
for k, v in sorted(out.items()):
    print(k[0], k[1], v)
