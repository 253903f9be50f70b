"""Generate the golden vectors once. They are frozen: never rerun this to make a test pass.

A format change that alters any decoded bit must fail tests/test_golden.py; a deliberate
change is a new format version with new golden files beside these.
"""
import json
import os

import torch
from safetensors.torch import save_file

import escha
from escha.format import decode_tiles, decode_trellis

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    g = torch.Generator().manual_seed(20261129)
    streams = {}
    for k in (1, 2, 3, 4):
        words = torch.randint(-2**31, 2**31, (4, 8 * k), generator=g, dtype=torch.int64).to(torch.int32)
        vals = decode_tiles(words, k).reshape(4, 256)
        streams[str(k)] = [{"words": [f"{w & 0xFFFFFFFF:08x}" for w in row.tolist()],
                            "fp16": [f"{v & 0xFFFF:04x}" for v in vrow.view(torch.int16).tolist()]}
                           for row, vrow in zip(words, vals)]
    with open(os.path.join(HERE, "bitstreams.json"), "w") as f:
        json.dump(streams, f, indent=1)

    w = torch.randn(40, 200, generator=g)
    qw = escha.quantize(w, bits=2, seed=7)
    escha.save_file({"layer.weight": qw}, os.path.join(HERE, "qweight_k2.safetensors"))
    save_file({"core_fp16": decode_trellis(qw), "dequantized": escha.dequantize(qw)},
              os.path.join(HERE, "qweight_k2_expected.safetensors"))


if __name__ == "__main__":
    main()
