"""The supported Triton range is declared once in each of three places that must agree: the
package requirement, the kernels' version switch and the CI script that tests both ends."""
import os
import re

import triton

from escha.kernels.compile_check import kernel_names
from escha.kernels.triton_compat import MAX_TRITON, MIN_TRITON, TRITON_RELEASE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def test_requirement_switch_and_ci_agree():
    low, high = re.search(r'"triton>=(\d+\.\d+),<(\d+\.\d+)"', _read("pyproject.toml")).groups()
    assert tuple(map(int, low.split("."))) == MIN_TRITON
    assert tuple(map(int, high.split("."))) == (MAX_TRITON[0], MAX_TRITON[1] + 1)
    ci = _read(".ci", "run")
    lowest = re.search(r"^TRITON_LOWEST=(\d+)\.(\d+)\.\d+$", ci, re.M).groups()
    highest = re.search(r"^TRITON_HIGHEST=(\d+)\.(\d+)\.\d+$", ci, re.M).groups()
    assert tuple(map(int, lowest)) == MIN_TRITON and tuple(map(int, highest)) == MAX_TRITON


def test_installed_triton_is_in_range():
    assert MIN_TRITON <= TRITON_RELEASE <= MAX_TRITON, triton.__version__


def test_compile_check_knows_every_kernel():
    # The check fails when a kernel is not launched by it; this pins what "every kernel" is today.
    assert kernel_names() == {
        "_decode_kernel", "_decode_wgmma_kernel", "_decode_fp8_kernel", "_fragment_kernel", "_dequant_kernel", "dequant_hn_kernel",
        "prefill_kernel", "core_gemm_kernel",
        "_input_transform_kernel", "_output_transform_kernel", "_output_hadamard_kernel", "_dp_chunk_kernel", "_traceback_kernel"}
