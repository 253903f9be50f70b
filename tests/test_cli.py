"""The escha command line: help, argument errors, and the demo end to end."""
import os
import subprocess
import sys

import pytest
import torch

from escha.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "demo" in out


def test_no_subcommand_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        main([])
    assert e.value.code == 2
    assert "required" in capsys.readouterr().err


def test_demo_bad_bits(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bits", "7"])
    assert e.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, message", [
    ("--out-features", "0", "argument --out-features: must be at least 1, got 0"),
    ("--out-features", "-5", "argument --out-features: must be at least 1, got -5"),
    ("--in-features", "0", "argument --in-features: must be at least 1, got 0"),
    ("--m", "-1", "argument --m: must be at least 1, got -1"),
    ("--m", "0", "argument --m: must be at least 1, got 0"),
    ("--m", "two", "argument --m: expected a positive integer, got 'two'"),
])
def test_demo_refuses_empty_and_negative_sizes(capsys, option, value, message):
    with pytest.raises(SystemExit) as e:
        main(["demo", option, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"escha demo: error: {message}" and "Traceback" not in err


def test_demo_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for d in ("bits per weight of the trellis code (default 2)", "rows of the sample matrix (default 128)",
              "columns of the sample matrix (default 256)", "by the quantized matrix (default 8)",
              "the sign vectors (default 0)"):
        assert d in text, d


def test_demo_runs_and_checks(capsys):
    # The greedy encoder keeps this CPU test fast; the demo's default is the Viterbi encoder.
    assert main(["demo", "--out-features", "64", "--in-features", "96", "--m", "3", "--encoder", "greedy"]) == 0
    out = capsys.readouterr().out
    assert "rate-distortion bound 0.0625" in out
    assert "PASS" in out
    if not torch.cuda.is_available():  # the tests run kernels in the interpreter, as the demo does
        assert "(torch.float16, M=3, path decode, its Triton kernel in Triton's CPU interpreter)" in out


def test_demo_names_the_reference_path_when_kernels_cannot_run(capsys, monkeypatch):
    from escha.kernels import common
    monkeypatch.setattr(common, "_INTERPRETED", False)  # as on a CPU where Triton was imported first
    if torch.cuda.is_available():
        pytest.skip("with a GPU the kernels run")
    assert main(["demo", "--out-features", "64", "--in-features", "96", "--m", "3", "--encoder", "greedy"]) == 0
    assert "path reference, the PyTorch reference codec)" in capsys.readouterr().out


def test_import_leaves_the_interpreter_choice_open():
    """`import escha` imports no Triton, so `escha demo` can still turn the interpreter on."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = "import sys, escha, escha.cli; assert 'triton' not in sys.modules, 'triton imported'"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
