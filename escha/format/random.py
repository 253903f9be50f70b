"""Random QuantizedWeights: valid files with random trellis bits, for kernel tests and benchmarks."""
from __future__ import annotations

import torch

from .qweight import QuantizedWeight, check_shape
from .spec import TILE, check_bits, padded, words_per_tile


def random_qweight(out_features: int, in_features: int, bits: int = 2, seed: int = 0,
                   device: torch.device | str = "cpu") -> QuantizedWeight:
    """A QuantizedWeight with uniformly random trellis words, signs and scales near 1/sqrt(in).

    Every bit pattern is a valid tail-biting stream, so random words are a valid weight; such a
    weight is what a kernel sees and costs nothing to make at full model size. ``seed`` fixes
    every value; ``device`` is where the tensors are put. A non-integer or non-positive
    dimension raises FormatError.
    """
    out_features, in_features = check_shape((out_features, in_features))
    check_bits(bits)
    g = torch.Generator().manual_seed(seed)
    np_, kp = padded(out_features), padded(in_features)
    trellis = torch.randint(-2**31, 2**31, (np_ // TILE, kp // TILE, words_per_tile(bits)),
                            generator=g, dtype=torch.int64).to(torch.int32)
    su = (torch.randint(0, 2, (np_,), generator=g) * 2 - 1).to(torch.int8)
    sv = (torch.randint(0, 2, (kp,), generator=g) * 2 - 1).to(torch.int8)
    scale = (0.75 + 0.5 * torch.rand(np_, generator=g)).to(torch.float16)
    gscale = torch.tensor([1.0 / (1.24 * in_features ** 0.5)], dtype=torch.float32)
    qw = QuantizedWeight(trellis, su, sv, scale, gscale, (out_features, in_features), bits)
    return qw.to(device)
