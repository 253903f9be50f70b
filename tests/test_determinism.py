"""Bitwise reproducibility on the GPU: 100 runs of every path give identical bits (split-K too)."""
import pytest
import torch

import escha
from escha.format import random_qweight

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def qw():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return random_qweight(5120, 8704, bits=2, seed=3, device="cuda")


@pytest.mark.parametrize("m", [1, 8, 64, 200, 600])
def test_every_path_is_bitwise_reproducible(qw, m):
    from escha.ops import available_paths
    x = torch.randn(m, qw.in_features, device="cuda", dtype=torch.bfloat16)
    for path in available_paths(qw, m):
        first = escha.matmul(x, qw, path=path)
        for _ in range(99):
            again = escha.matmul(x, qw, path=path)
            assert torch.equal(again.view(torch.int16), first.view(torch.int16)), f"{path} at M={m}"


def test_split_k_reduction_is_reproducible(qw):
    from dataclasses import replace

    from escha.kernels import decode, decode_config
    x = torch.randn(8, qw.in_features, device="cuda", dtype=torch.float16)
    cfg = replace(decode_config(qw, 8), split=8)
    first = decode(x, qw, config=cfg)
    for _ in range(99):
        assert torch.equal(decode(x, qw, config=cfg).view(torch.int16), first.view(torch.int16))
    one = decode(x, qw, config=replace(cfg, split=1))
    torch.testing.assert_close(first.float(), one.float(), rtol=2e-3, atol=2e-3)
