"""Frozen golden vectors (tests/golden/make_golden.py made them once; never regenerate)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file as st_load

import escha
from escha.format import decode_tiles, decode_trellis

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _i32(hexwords):
    return torch.tensor([int(h, 16) for h in hexwords], dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("k", ["1", "2", "3", "4"])
def test_bitstream_golden(k):
    with open(os.path.join(HERE, "bitstreams.json")) as f:
        cases = json.load(f)[k]
    assert len(cases) == 4
    for case in cases:
        words = _i32(case["words"])
        assert words.numel() == 8 * int(k)
        got = decode_tiles(words, int(k)).reshape(256).view(torch.int16).tolist()
        want = [int(h, 16) for h in case["fp16"]]
        assert [v & 0xFFFF for v in got] == want


def test_quantized_tensor_golden():
    qw = escha.load_file(os.path.join(HERE, "qweight_k2.safetensors"))["layer.weight"]
    exp = st_load(os.path.join(HERE, "qweight_k2_expected.safetensors"))
    assert qw.shape == (40, 200) and qw.bits == 2
    assert torch.equal(decode_trellis(qw).view(torch.int16), exp["core_fp16"].view(torch.int16))
    deq = escha.dequantize(qw)
    assert deq.shape == (40, 200)
    # The stored W came from float32 Hadamard products (within 4.2e-7 of the correctly rounded W
    # that dequantize returns, in any BLAS build); docs/FORMAT.md section 10.
    torch.testing.assert_close(deq, exp["dequantized"], rtol=1e-5, atol=1e-6)
