"""The verdict on a compute-sanitizer report of benchmarks/run_sanitizer.sh: which kernels each
report names, escha's or a library's, and whether the run passes.

    python benchmarks/sanitizer_verdict.py REPORT   (prints the verdict; exit 0 pass, 1 fail)

A kernel is a library's when its name has a library's prefix (LIBRARY: cuBLAS's `nvjet_sm90_*`
GEMMs, which the prefill paths and the benchmarks call, CUTLASS's, PyTorch's) and the repository
defines no function of that name; every other kernel counts as escha's, those unknown here too.
Run it in the tree that made the report (a candidate patch applied). The run fails on any memcheck error,
wherever it is (a library kernel reading out of bounds may have been handed escha's pointers), on
any racecheck report in escha's kernels, on reports left unprinted, on a case that failed its gate, and on a tool that
exited non-zero with no report to account for it (a crash), and on any report under no tool's
heading. Racecheck reports inside library
kernels are listed and do not fail it: racecheck reports hazards inside cuBLAS's own GEMMs
(docs/KERNELS.md, "Reliability checks"), and compute-sanitizer's `--kernel-name` filter, which
would leave them out, stops with an internal error on the setups measured.
"""
from __future__ import annotations

import collections
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
_AT = re.compile(r"\bat (?:0x[0-9a-f]+ in )?([A-Za-z_][\w]*)(?:\([^)]*\))?\+0x[0-9a-f]+")
_CASES = re.compile(r"sanitizer cases: (\d+) run, (\d+) failed")
_EXIT = re.compile(r"^exit code: (\d+)")
_TOOL = re.compile(r"^## (\w+)")
LIBRARY = re.compile(r"^(nvjet_|cutlass|sm\d+_xmma|sm\d+_|ampere_|hopper_|cublas|_ZN2at|_ZN7cutlass|at::|void at::)")


def escha_kernels(root: pathlib.Path = ROOT) -> set[str]:
    """Names of the functions defined in escha/ and benchmarks/ (Python and CUDA sources)."""
    names: set[str] = set()
    for folder in ("escha", "benchmarks"):
        for path in (root / folder).rglob("*"):
            if path.suffix in (".py", ".cu") and path.is_file():
                text = path.read_text(errors="replace")
                names.update(re.findall(r"^\s*def (\w+)\(", text, re.M))
                names.update(re.findall(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\(", text))
    return names


def verdict(report: str, ours: set[str]) -> tuple[bool, list[str]]:
    """(passes, lines saying why) for the text of one run_sanitizer.sh report."""
    tool, failures, lines = "?", [], []
    reports: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    explained: dict[str, bool] = {}
    current: list[str] = []  # the kernels named by the report being read
    for line in report.splitlines():
        if m := _TOOL.match(line):
            tool = m.group(1)
            continue
        if line.startswith("========= Error:") or re.match(r"^========= (Invalid|Race|Barrier|Uninitialized|Misaligned)", line):
            current = []
        for name in _AT.findall(line):  # a report counts once for each kernel it names
            if name not in current:
                current.append(name)
                owner = "library" if LIBRARY.match(name) and name not in ours else "escha"
                reports[(tool, owner)][name] += 1
                explained[tool] = True
        if m := _CASES.search(line):
            if int(m.group(2)):
                failures.append(f"{tool}: {m.group(2)} of {m.group(1)} cases failed their gate")
        if "not printed" in line:  # reports past --print-limit: their kernels are unknown
            failures.append(f"{tool}: {line.strip('= ')} (raise ESCHA_SANITIZER_PRINT_LIMIT)")
        if m := _EXIT.match(line):
            if int(m.group(1)) and not explained.get(tool):
                failures.append(f"{tool}: exit code {m.group(1)} with no report naming a kernel")
    for (tool, owner), counts in sorted(reports.items()):
        listed = ", ".join(f"{k} ({n} report{'s' if n > 1 else ''})" for k, n in counts.most_common())
        if tool != "racecheck" or owner == "escha":
            failures.append(f"{tool}: reports in {owner} kernels: {listed}")
        else:
            lines.append(f"{tool}: reports in library kernels only, not escha's (not a failure): {listed}")
    return not failures, failures + lines


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.split("\n\n")[1].strip())
        return 2
    ok, why = verdict(pathlib.Path(sys.argv[1]).read_text(errors="replace"), escha_kernels())
    print(f"verdict: {'pass' if ok else 'FAIL'}")
    for line in why:
        print(f"  {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
