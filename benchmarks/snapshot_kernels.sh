#!/usr/bin/env bash
# Copies of the two decode GEMM modules and their transforms, for an A/B in one process (run from
# the repository root):
#   benchmarks/snapshot_kernels.sh LABEL [REV]
# writes .prev/decode_wgmma_LABEL.py, .prev/decode_fp8_LABEL.py and .prev/transforms_LABEL.py, from
# commit REV (git show) or, without one, from the working tree; with SED set, decode_wgmma's copy
# is passed through `sed -e "$SED"` (a variant of the working tree's codec). The copies import each
# other, not the package's modules (the input transform's fp8 factor belongs to the GEMM's weight
# scale), and the package's common, format and norm modules. bench_decode_wgmma.py /
# bench_decode_fp8.py --previous .prev/decode_<op>_LABEL.py time each as the arm <op>@LABEL.
set -eu
LABEL=${1:?label}
REV=${2:-}
mkdir -p .prev
src() { if [ -n "$REV" ]; then git show "$REV:escha/kernels/$1"; else cat "escha/kernels/$1"; fi; }
src decode_wgmma.py | sed -e "${SED:-}" > ".prev/decode_wgmma_$LABEL.py.in"
src decode_fp8.py > ".prev/decode_fp8_$LABEL.py.in"
src transforms.py > ".prev/transforms_$LABEL.py.in"
LABEL=$LABEL python - <<'PY'
import os
label = os.environ["LABEL"]


def loader(module: str) -> str:
    """Code that loads .prev/<module>_<label>.py as escha.kernels._<module>_<label>, once."""
    return (f"import importlib.util as _ilu\nimport os as _os\nimport sys as _sys\n"
            f"if 'escha.kernels._{module}_{label}' not in _sys.modules:\n"
            f"    _spec = _ilu.spec_from_file_location('escha.kernels._{module}_{label}', "
            f"_os.path.join(_os.path.dirname(__file__), '{module}_{label}.py'))\n"
            f"    _sys.modules[_spec.name] = _ilu.module_from_spec(_spec)\n"
            f"    _spec.loader.exec_module(_sys.modules[_spec.name])\n")


for name, imports in (("transforms", ()), ("decode_wgmma", ("transforms",)), ("decode_fp8", ("decode_wgmma", "transforms"))):
    path = f".prev/{name}_{label}.py"
    s = open(path + ".in").read()
    for module in imports:
        line = f"from .{module} import "
        assert s.count(line) == 1, f"{name} imports {module} otherwise now"
        s = s.replace(line, loader(module) + f"from ._{module}_{label} import ")
    open(path, "w").write(s)
    os.remove(path + ".in")
PY
