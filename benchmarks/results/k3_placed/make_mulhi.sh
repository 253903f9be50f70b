#!/usr/bin/env bash
# The candidate's other form as arms of the same benchmark (run from the repository root, after
# candidate.patch is applied): state s + 8 taken out by mul.hi.u32 by 2**16 (IMAD.HI, FMA-heavy)
# instead of shr.u32 16, in copies of the patched modules under .prev/ (decode_wgmma_mulhi.py,
# and decode_fp8_mulhi.py importing it), for bench_decode_wgmma.py / bench_decode_fp8.py --previous.
set -eu
mkdir -p .prev
sed -e 's/shr\.u32 sb, \$3, 16;/mul.hi.u32 sb, $3, 65536;/' -e 's/shr\.u32 sb, \$5, 16;/mul.hi.u32 sb, $5, 65536;/' \
    escha/kernels/decode_wgmma.py > .prev/decode_wgmma_mulhi.py
[ "$(grep -c 'mul.hi.u32 sb' .prev/decode_wgmma_mulhi.py)" = 2 ] || { echo "mul.hi form not made"; exit 1; }
python - <<'PY'
s = open("escha/kernels/decode_fp8.py").read()
shim = '''import importlib.util as _ilu
import os as _os
import sys as _sys
_NAME = "escha.kernels._decode_wgmma_mulhi"
if _NAME not in _sys.modules:
    _spec = _ilu.spec_from_file_location(_NAME, _os.path.join(_os.path.dirname(__file__), "decode_wgmma_mulhi.py"))
    _mod = _ilu.module_from_spec(_spec)
    _sys.modules[_NAME] = _mod
    _spec.loader.exec_module(_mod)
from ._decode_wgmma_mulhi import ('''
assert s.count("from .decode_wgmma import (") == 1
open(".prev/decode_fp8_mulhi.py", "w").write(s.replace("from .decode_wgmma import (", shim))
PY
