"""CPU encoder support: the thread governor's decisions and the run-time estimate."""
from __future__ import annotations

import pytest
import torch

from escha.quant.cpu_threads import ThreadGovernor, choose_threads, read_sample
from escha.quant.estimate import CPU_TILES_PER_S, CUDA_TILES_PER_S, encoder_tiles_per_s, estimate_seconds


def test_choose_threads() -> None:
    assert choose_threads(2, 2, 0.0) == 2
    assert choose_threads(2, 2, 0.2) == 2
    assert choose_threads(2, 2, 0.3) == 1  # a third of a core in use elsewhere: barriers would stall
    assert choose_threads(2, 2, 1.0) == 1
    assert choose_threads(2, 2, 5.0) == 1
    assert choose_threads(1, 16, 0.0) == 1
    assert choose_threads(16, 16, 3.0) == 13
    assert choose_threads(8, 16, 0.0) == 8


def test_governor_follows_other_processes() -> None:
    """Fake /proc samples (wall, machine busy, own CPU): one thread first, all threads once a
    window shows the other core idle, one again when another process starts."""
    samples = iter([(0.0, 0.0, 0.0),
                    (0.1, 0.1, 0.1),  # window too short: no decision
                    (0.5, 0.5, 0.5),  # only this process busy
                    (1.0, 1.5, 1.4),  # others used 0.1 / 0.5 s = 0.2 cores
                    (1.5, 2.5, 1.9)])  # others used 0.5 / 0.5 s = 1 core
    n = torch.get_num_threads()
    gov = ThreadGovernor(max_threads=2, cores=2, sample=lambda: next(samples))
    try:
        assert [gov.before_block() for _ in range(4)] == [1, 2, 2, 1]
        assert gov.blocks == {1: 2, 2: 2}
    finally:
        gov.restore()
    assert torch.get_num_threads() == n


def test_governor_without_proc_and_fixed() -> None:
    n = torch.get_num_threads()
    try:
        assert ThreadGovernor(max_threads=3, sample=lambda: None).before_block() == 3  # like torch
        gov = ThreadGovernor.fixed(1)
        assert gov.before_block() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n)


def test_read_sample() -> None:
    s = read_sample()
    if s is None:
        pytest.skip("no /proc/stat here")
    wall, busy, own = s
    assert wall > 0 and busy >= 0 and own >= 0


def test_estimate_seconds() -> None:
    rate = encoder_tiles_per_s(2, "cpu", threads=1)
    assert rate == CPU_TILES_PER_S[1][2] > 0
    assert encoder_tiles_per_s(2, "cpu", threads=8) == CPU_TILES_PER_S[2][2]
    assert encoder_tiles_per_s(2, torch.device("cuda")) == CUDA_TILES_PER_S[2]
    assert encoder_tiles_per_s(4, "cuda") == CUDA_TILES_PER_S[3]  # nearest measured K
    # 1024 tiles (512 x 512) plus the CPU scale search: 5 factors x 8 tiles x one 256-step pass.
    want = (1024 + 5 * 8 * 256 / 384) / rate
    assert estimate_seconds(1024, 2, "cpu") == pytest.approx(want)
    assert estimate_seconds(1024, 2, "cpu", scale_search=False) == pytest.approx(1024 / rate)
    assert estimate_seconds(3, 2, "cpu", tiles_per_s=10.0) == pytest.approx((3 + 5 * 3 * 256 / 384) / 10)
    assert estimate_seconds(0, 2) == 0.0
    assert estimate_seconds(10**6, 2, "cuda") < estimate_seconds(10**6, 2, "cpu", threads=2)
    with pytest.raises(ValueError):
        estimate_seconds(-1, 2)
    with pytest.raises(ValueError):
        estimate_seconds(1, 2, tiles_per_s=0.0)
