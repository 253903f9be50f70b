"""common.launch: a compiled kernel is kept per specialization and launched directly after.

The CPU tests check what separates two specializations; the GPU tests launch a real kernel
through both paths (Triton's on the first call of a key, the kept kernel after) with fresh,
poisoned outputs, and check that a change Triton would specialize on compiles a new variant.
"""
import pytest
import torch
import triton
import triton.language as tl

from escha.kernels import common
from escha.kernels.common import _specialization, launch


def test_specialization_separates_what_triton_specializes_on():
    x = torch.zeros(64, dtype=torch.float16)
    assert _specialization(x) == (torch.float16, True)
    assert _specialization(x[1:]) == (torch.float16, False)  # 2 bytes off a 16-byte boundary
    assert _specialization(x[8:]) == (torch.float16, True)
    assert _specialization(x.float()) != _specialization(x)
    ints = [_specialization(v) for v in (1, 16, 17, 2**31, -1)]
    assert len(set(ints)) == len(ints)  # 1, divisible by 16, neither, and the widths all differ
    assert _specialization(3) == _specialization(5)  # an ordinary int is not a key of its own
    assert _specialization(True) != _specialization(1)
    assert _specialization(0.5) == _specialization(2.0)
    assert _specialization(None) == "none"
    assert _specialization("text") is None  # unknown types take Triton's own launch


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, stride, BLOCK: tl.constexpr, PLUS: tl.constexpr = 1.0):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + i * stride, mask=i < n)
    tl.store(y_ptr + i, v * a + PLUS, mask=i < n)


def _run(x: torch.Tensor, n: int, a: float, **kwargs):
    y = torch.full((n,), float("nan"), device=x.device, dtype=x.dtype)  # poisoned
    compiled = launch(_axpb_kernel, (triton.cdiv(n, 128),), x, y, n, a, x.stride(0), BLOCK=128, **kwargs)
    torch.testing.assert_close(y, x[:n] * a + kwargs.get("PLUS", 1.0), rtol=0, atol=1e-6)
    return compiled


@pytest.mark.gpu
def test_launch_keeps_one_kernel_per_specialization():
    dev = torch.device("cuda")
    common._COMPILED.clear()
    base = torch.randn(4096, device=dev)
    first = _run(base.clone(), 1000, 0.5)
    assert len(common._COMPILED) == 1
    # Same key, fresh operands and scalars: the kept kernel, launched directly.
    for _ in range(3):
        assert _run(torch.randn(4096, device=dev), 1000, -2.0) is first
    assert len(common._COMPILED) == 1
    # What Triton specializes on compiles (and keeps) a new variant each.
    seen = {id(first)}
    big = torch.randn(16 * 1024, device=dev)
    for x, n, kwargs in ((base[1:], 1000, {}),  # 4 bytes off alignment
                         (base, 1, {}),  # n == 1
                         (base, 1008, {}),  # n divisible by 16
                         (base[::2], 1000, {}),  # stride 2 instead of 1
                         (big[::16], 1000, {}),  # stride divisible by 16
                         (base, 1000, {"num_warps": 8}),  # a launch option
                         (base, 1000, {"PLUS": 3.0})):  # a constexpr by keyword
        compiled = _run(x, n, 0.25, **kwargs)
        assert id(compiled) not in seen
        seen.add(id(compiled))
        assert _run(x, n, 0.75, **kwargs) is compiled  # and its second launch is direct
    assert len(common._COMPILED) == 8
    assert _run(base[4:], 1000, 1.5) is first  # 16 bytes on: aligned again, the first variant
