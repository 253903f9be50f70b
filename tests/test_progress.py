"""escha.quantize's progress: a tqdm bar on a terminal (or when asked), quiet elsewhere, a caller's
callback, and the warning before work that the measured rates say will take long."""
import importlib
import math
import sys
import warnings

import pytest
import torch

from escha.progress import SlowWorkWarning
from escha.quant import quantize

qmod = importlib.import_module("escha.quant.quantize")  # the module (the package exports the function)
W = torch.randn(16, 128, generator=torch.Generator().manual_seed(0))  # pads to 128 x 128: 64 tiles


def test_bar_when_asked(capsys):
    quantize(W, 2, encoder="greedy", progress=True)
    err = capsys.readouterr().err
    assert "escha.quantize: 100%" in err and "64/64" in err and "tile" in err


def _draws(progress, n_tiles: int) -> bool:
    report = qmod._reporter(progress, (16, 128), n_tiles, 2, torch.device("cpu"), qmod.Encoder.VITERBI, True)
    report.close()
    return report.bar is not None


def test_the_default_draws_only_on_a_terminal_and_for_long_encodes(capsys, monkeypatch):
    monkeypatch.setattr(qmod, "SLOW_SECONDS", math.inf)
    assert not _draws(None, 100_000)  # off a terminal (capsys): never
    assert _draws(True, 64) and not _draws(False, 100_000)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert _draws(None, 100_000) and not _draws(None, 16)  # on one: when estimated over 2 s
    capsys.readouterr()
    monkeypatch.setattr(qmod, "BAR_MIN_SECONDS", 0.0)  # a real encode, drawn as on a terminal
    quantize(W, 2, scale_search=None)
    err = capsys.readouterr().err
    assert "escha.quantize: 100%" in err and "64/64" in err


def test_callback_gets_every_tile_and_nothing_is_drawn(capsys):
    seen = []
    quantize(W, 2, encoder="greedy", progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1] == (64, 64)
    assert all(t == 64 for _, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert capsys.readouterr().err == ""


def test_slow_work_is_announced_before_it_starts(monkeypatch):
    monkeypatch.setattr(qmod, "SLOW_SECONDS", 0.0)  # every encode counts as slow
    with pytest.warns(SlowWorkWarning) as record:
        quantize(W, 2, scale_search=None)
    (w,) = record
    assert w.filename == __file__  # attributed to the caller of escha.quantize
    msg = str(w.message)
    assert msg.startswith("quantizing 16x128 (64 tiles at K=2) will take about") and "on the CPU" in msg
    assert "tiles/s" in msg and "an H200 takes" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowWorkWarning)
        _draws(False, 100_000)  # False: no notice either
        qmod._reporter(None, (16, 128), 100_000, 2, torch.device("cpu"), qmod.Encoder.GREEDY, True)  # never


def test_bad_encoder_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"^encoder must be one of viterbi, greedy; got 'fast'$"):
        quantize(W, 2, encoder="fast")
