#!/usr/bin/env bash
# The previous kernels for the A/B (run from the repository root): decode_wgmma.py and decode_fp8.py at
# 52b2e88 (the pair codec's first state by mul.hi) into .prev/, the fp8 file importing its own
# decode_wgmma (its helpers are imported from there, and today's take the state by a shift).
# Another commit: make_prev.sh REV.
set -eu
REV=${1:-52b2e88}
mkdir -p .prev
git show $REV:escha/kernels/decode_wgmma.py > .prev/decode_wgmma_$REV.py
git show $REV:escha/kernels/decode_fp8.py > .prev/decode_fp8_$REV.py
REV=$REV python - <<'PY'
import os
rev = os.environ["REV"]
p = f".prev/decode_fp8_{rev}.py"
s = open(p).read()
shim = '''import importlib.util as _ilu
import os as _os
import sys as _sys
_NAME = "escha.kernels._decode_wgmma_REV"
if _NAME not in _sys.modules:
    _spec = _ilu.spec_from_file_location(_NAME, _os.path.join(_os.path.dirname(__file__), "decode_wgmma_REV.py"))
    _mod = _ilu.module_from_spec(_spec)
    _sys.modules[_NAME] = _mod
    _spec.loader.exec_module(_mod)
from ._decode_wgmma_REV import ('''.replace("REV", rev)
assert s.count("from .decode_wgmma import (") == 1
open(p, "w").write(s.replace("from .decode_wgmma import (", shim))
PY
grep -c "mul.hi.u32 sa\|shr.u32 sa" .prev/decode_wgmma_$REV.py
