"""benchmarks/sanitizer_verdict.py: the verdict on compute-sanitizer reports, on a real report
(racecheck of the prefill paths on an H100, whose only reports are inside cuBLAS's GEMMs) and on
that report changed to hold what must fail."""
from __future__ import annotations

import pathlib

from benchscripts import load

ROOT = pathlib.Path(__file__).resolve().parents[1]
REAL = ROOT / "benchmarks/results/h100_9ff1615/gpu_suite/sanitizer_racecheck.txt"


def _module():
    return load("sanitizer_verdict")


def test_library_races_alone_pass_and_are_listed():
    sv = _module()
    ok, why = sv.verdict(REAL.read_text(), sv.escha_kernels())
    assert ok and len(why) == 1 and "library kernels only" in why[0]
    assert "nvjet_sm90_tst_64x8_64x16_2x4_h_bz_TNT (12 reports)" in why[0]


def test_what_must_fail_fails():
    sv = _module()
    ours = sv.escha_kernels()
    assert {"_decode_fp8_kernel", "_dequant_kernel", "_output_transform_kernel"} <= ours
    text = REAL.read_text()
    race = ("========= Error: Race reported between Read access at _decode_fp8_kernel+0x130 in decode_fp8.py:615\n"
            "=========     and Write access at _decode_fp8_kernel+0x2300 in decode_fp8.py:615 [39 hazards]\n")
    cases = {
        "a race in escha's kernel": text.replace("sanitizer cases: 72 run", race + "sanitizer cases: 72 run"),
        "a failed case": text.replace("72 run, 0 failed", "72 run, 1 failed"),
        "a crash": text.replace("========= Error: Race", "========= Note: Race").replace(" at nvjet", " in nvjet"),
        "a memcheck error in a library kernel": text.replace("## racecheck", "## memcheck"),
        "a kernel no library is known by": text.replace("nvjet_sm90_tst", "mystery_kernel"),
        "reports left unprinted": text.replace("sanitizer cases: 72 run",
                                               "========= 12 errors were not printed\nsanitizer cases: 72 run"),
    }
    for name, changed in cases.items():
        assert changed != text, name
        ok, why = sv.verdict(changed, ours)
        assert not ok and why, name
