import pytest
import torch

from escha.format import block_hadamard, hadamard_matrix


@pytest.mark.parametrize("n", [1, 2, 16, 128])
def test_orthonormal_symmetric(n):
    h = hadamard_matrix(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert torch.allclose(h.abs(), torch.full_like(h, n ** -0.5))


def test_sylvester_sign_rule():
    h = hadamard_matrix(128, torch.float64) * 128 ** 0.5
    i, j = 37, 101
    assert h[i, j] == (-1) ** bin(i & j).count("1")


def test_block_transform_matches_dense_and_is_involution():
    x = torch.randn(3, 256, dtype=torch.float64)
    y = block_hadamard(x, dim=-1)
    dense = torch.block_diag(hadamard_matrix(128, torch.float64), hadamard_matrix(128, torch.float64))
    assert torch.allclose(y, x @ dense, atol=1e-12)
    assert torch.allclose(block_hadamard(y, dim=-1), x, atol=1e-12)
    z = block_hadamard(x.T, dim=0)
    assert torch.allclose(z, y.T, atol=1e-12)


def test_errors():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(12)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        block_hadamard(torch.randn(2, 100))
