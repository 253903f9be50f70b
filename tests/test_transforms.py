"""The activation transform of the decode GEMMs (escha.kernels.transforms.hadamard_input) against
its PyTorch reference, escha.format.input_transform (under the Triton interpreter on a CPU)."""
from __future__ import annotations

import pytest
import torch

from escha.format import input_transform, random_qweight
from escha.kernels.decode_wgmma import mma_column_order
from escha.kernels.transforms import hadamard_input
from escha.norm import RowNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, qw, norm: RowNorm | None) -> torch.Tensor:
    """x' = Hk (sv * pad(norm(x))) in fp64 from the reference codec (fp32 Hadamard products)."""
    return input_transform(x if norm is None else norm.apply(x), qw).double()


@pytest.mark.parametrize("k", [300, 5120, 8200])  # one row load, one exact, two (8192 at a time)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_norm", [False, True])
def test_hadamard_input_against_the_reference(k, dtype, with_norm):
    """x' * 2**e rounds once to fp16 (relative 2**-11 an element, measured normwise here), its
    scale 2**-e is a power of two that keeps |x' * 2**e| <= 2**15, and the MMA column order is a
    permutation of each 128-block."""
    g = torch.Generator().manual_seed(k + 7 * with_norm)
    qw = random_qweight(64, k, 2, seed=k, device=DEV)
    x = (torch.randn(3, k, generator=g) * torch.tensor([1e-3, 1.0, 300.0])[:, None]).to(DEV, dtype)
    norm = RowNorm((torch.rand(k, generator=g) + 0.5).to(DEV, dtype), 1e-6) if with_norm else None
    want = reference(x, qw, norm)
    xq, inv = hadamard_input(x, qw, norm=norm)
    assert xq.dtype == torch.float16 and xq.shape == (3, qw.padded_shape[1]) and inv.shape == (3,)
    e = torch.log2(inv.double())
    assert torch.equal(e, e.round())  # powers of two: the scaling itself is exact
    assert xq.double().abs().max() <= 2.0 ** 15
    got = xq.double() * inv.double()[:, None]
    rel = ((got - want).norm(dim=1) / want.norm(dim=1)).max().item()
    # fp16 rounding 2**-11 a value; with the norm, the model's own rounding of the normalised x to
    # its dtype (bf16 2**-8) can land the other way where the kernel's fp32 mean square differs
    # from torch's by an ulp, so the bound is the dtype's unit roundoff there.
    tol = 2.0 ** -11 if norm is None or dtype == torch.float32 else (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11)
    assert rel <= 2 * tol, rel
    # The MMA column order stores each 128-block permuted, nothing else.
    xo, invo = hadamard_input(x, qw, mma_order=True, norm=norm)
    assert torch.equal(invo, inv)
    order = mma_column_order(DEV)
    blocks = xq.view(3, -1, 128)
    assert torch.equal(xo.view(3, -1, 128).view(torch.int16), blocks[:, :, order].view(torch.int16))
