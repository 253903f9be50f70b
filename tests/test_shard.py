"""Block-aligned shards of a QuantizedWeight (docs/FORMAT.md, Tensor parallelism): concatenated,
every rank's shard gives back the whole weight's dequantization bit for bit."""
import pytest
import torch

import escha
from escha.format import random_qweight
from escha.format.shard import ShardError, shard_plan, supported_degrees


# -- shards of one weight --------------------------------------------------------------------------

# Row and column counts on and off the 128-block grid: 200 = 2 blocks (the last 72 rows real),
# 520 = 5 blocks, 130 = 2 blocks (2 real rows in the second), 1000 = 8 blocks.
SHAPES = [(256, 256), (200, 520), (130, 7), (1000, 300), (384, 1030)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dim", [0, 1])
def test_shards_concatenate_to_the_whole_dequantization(shape, dim):
    qw = random_qweight(*shape, bits=2, seed=sum(shape) + dim)
    whole = escha.dequantize(qw)
    degrees = supported_degrees(shape[dim])
    for ws in degrees:
        shards = [qw.shard(dim, r, ws) for r in range(ws)]
        for s in shards:
            s.validate()
            assert torch.equal(s.gscale, qw.gscale) and s.bits == qw.bits
            assert s.shape[1 - dim] == shape[1 - dim]
        # Equal whole blocks per rank; only the last rank's logical size can be shorter.
        sizes = [s.shape[dim] for s in shards]
        assert sum(sizes) == shape[dim] and len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0]
        assert torch.equal(torch.cat([escha.dequantize(s) for s in shards], dim), whole), (ws, sizes)
    if shape[dim] > 128:
        assert max(degrees) > 1  # every shape above is split somewhere


def test_shards_of_a_quantized_matrix_and_their_products():
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(0))
    qw = escha.quantize(w, bits=3, encoder="greedy")
    whole = escha.dequantize(qw)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    y = escha.matmul(x, qw, path="reference")
    cols = [qw.shard(1, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([escha.dequantize(c) for c in cols], 1), whole)
    # A row-parallel product is the sum of the column shards' partial products.
    part = sum(escha.matmul(x[:, r * 128:(r + 1) * 128], c, path="reference") for r, c in enumerate(cols))
    torch.testing.assert_close(part, y, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShardError, match="3 Hadamard blocks of 128 does not divide by 2.*supported: 1, 3"):
        qw.shard(0, 0, 2)


def test_fused_parts_are_split_part_by_part():
    for parts, ws in (([512, 256, 256], 2), ([1024, 512, 512], 4)):  # [q | k | v]
        qw = random_qweight(sum(parts), 200, seed=ws)
        whole = escha.dequantize(qw)
        shards = [qw.shard(0, r, ws, parts=parts) for r in range(ws)]
        for r, s in enumerate(shards):
            plan = shard_plan(qw.shape, 0, r, ws, parts)
            assert len(plan.ranges) == 3 and all((b - a) * ws == p for (a, b), p in zip(plan.ranges, parts))
            assert torch.equal(escha.dequantize(s), whole[plan.index()])
    with pytest.raises(ShardError, match="does not divide by 4"):
        random_qweight(768, 64).shard(0, 0, 4, parts=[512, 128, 128])
    with pytest.raises(ShardError, match="not a multiple of 128"):
        random_qweight(400, 64).shard(0, 0, 2, parts=[200, 200])
    # A fused dimension whose last part is padded: the padding stays at the end of the last rank.
    qw = random_qweight(256 + 200, 64, seed=4)
    last = qw.shard(0, 1, 2, parts=[256, 200])
    assert last.shape == (128 + 72, 64)
    assert torch.equal(escha.dequantize(last), escha.dequantize(qw)[[*range(128, 256), *range(384, 456)]])


def test_shard_errors():
    qw = random_qweight(256, 256)
    with pytest.raises(ShardError, match="rank 2 is outside world size 2"):
        qw.shard(0, 2, 2)
    with pytest.raises(ShardError, match="rank must be an integer, got float 0.0"):
        random_qweight(256, 128).shard(0, 0.0, 1)
    with pytest.raises(ShardError, match="rank -1"):
        qw.shard(1, -1, 2)
    with pytest.raises(ShardError, match="dim must be 0"):
        qw.shard(2, 0, 2)
    with pytest.raises(ShardError, match="world_size must be a positive integer"):
        qw.shard(0, 0, 0)
    with pytest.raises(ShardError, match="sum to 256"):
        qw.shard(0, 0, 2, parts=[128, 64])
    with pytest.raises(ShardError, match="columns of a 256x256 weight over 4 ranks: a part of 2"):
        qw.shard(1, 0, 4)
    assert supported_degrees(17408) == [1, 2, 4, 8, 17, 34, 68, 136]  # Qwen3-14B's intermediate size
