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


def test_quiet_off_a_terminal_and_drawn_on_one(capsys, monkeypatch):
    monkeypatch.setattr(qmod, "BAR_MIN_SECONDS", 0.0)  # any encode counts as long enough for a bar
    monkeypatch.setattr(qmod, "SLOW_SECONDS", math.inf)
    quantize(W, 2, scale_search=None)
    assert capsys.readouterr().err == ""  # the default off a terminal: nothing
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
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
        quantize(W, 2, scale_search=None, progress=False)  # False: no notice either
        quantize(W, 2, encoder="greedy")  # the greedy encoder is fast: never announced


def test_bad_encoder_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"^encoder must be one of viterbi, greedy; got 'fast'$"):
        quantize(W, 2, encoder="fast")
