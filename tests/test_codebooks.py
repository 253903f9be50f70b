"""The codebook registry and 3INST over all 2**16 states."""
import pytest
import torch

from escha import codebooks
from escha.format.codebooks import Codebook


def test_registry_lookup():
    cb = codebooks.get("3inst")
    assert cb.name == "3inst" and cb.id == 0
    assert codebooks.get(0) is cb
    assert "3inst" in codebooks.names()
    with pytest.raises(ValueError, match="unknown codebook 'nope'"):
        codebooks.get("nope")
    with pytest.raises(ValueError, match="unknown codebook 7"):
        codebooks.get(7)


def test_register_rejects_duplicates():
    class Dup(Codebook):
        name, id = "3inst", 99

        def values(self, states):
            return states.half()

    with pytest.raises(ValueError, match="already registered"):
        codebooks.register(Dup())


def test_3inst_known_values():
    cb = codebooks.get("3inst")
    # state 0: x = 64248484 = 0x03D45BA4 -> (x & 0x8FFF8FFF) ^ 0x3B603B60 = 0x38B431C4
    x = (64248484 & 0x8FFF8FFF) ^ 0x3B603B60
    lo = torch.tensor([x & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.float16)
    hi = torch.tensor([x >> 16], dtype=torch.int32).to(torch.int16).view(torch.float16)
    assert cb.values(torch.tensor([0]))[0] == (lo.float() + hi.float()).half()[0]
    assert x == 0x38B431C4


def test_3inst_statistics_over_all_states():
    t = codebooks.get("3inst").table().float()
    assert t.shape == (65536,)
    assert abs(float(t.mean())) < 0.01
    assert abs(float(t.std()) - 1.2437) < 1e-3
    # The mask/xor pins each half's exponent to 2**-3..2**0, so |value| < 4 (FORMAT.md).
    assert float(t.min()) == -3.95703125 and float(t.max()) == 3.97265625
    assert bool(torch.isfinite(t).all())


def test_values_dtype_shape_and_errors():
    cb = codebooks.get("3inst")
    s = torch.randint(0, 65536, (3, 5), dtype=torch.int32)
    v = cb.values(s)
    assert v.dtype == torch.float16 and v.shape == (3, 5)
    with pytest.raises(ValueError, match=r"\[0, 65535\]"):
        cb.values(torch.tensor([65536]))
    with pytest.raises(TypeError, match="integer"):
        cb.values(torch.tensor([1.0]))
