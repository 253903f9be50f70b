"""escha eval / escha.model.evaluate on a tiny random Llama: values, windowing, CLI and errors."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from escha.model import evaluate  # noqa: E402
from escha.model.calib import BUILTIN_TEXT  # noqa: E402
from escha.model.evaluate import EvalInputError, evaluate_dir, perplexity, window_starts  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 256
SEQ = 64


def make_llama(path, zero_head: bool = False):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if zero_head:
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    make_llama(path)
    return path


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    # No tokenizer in the checkpoint: UTF-8 bytes are the tokens, so this is ~4 kB = ~60 windows.
    p = tmp_path_factory.mktemp("text") / "eval.txt"
    p.write_text("\n\n".join(BUILTIN_TEXT[:20]), encoding="utf-8")
    return str(p)


def run_cli(*args, timeout=300):
    # Without TRITON_INTERPRET a CPU process runs escha.matmul on its reference path (fast).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "escha.cli", "eval", *args], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_perplexity_is_finite_reproducible_and_batch_independent(llama, text):
    a = evaluate_dir(llama, text, SEQ, max_windows=6)
    b = evaluate_dir(llama, text, SEQ, max_windows=6, batch_size=4)
    assert math.isfinite(a.perplexity) and 1 < a.perplexity < 10 * VOCAB
    assert a.perplexity == evaluate_dir(llama, text, SEQ, max_windows=6).perplexity
    assert b.perplexity == pytest.approx(a.perplexity, rel=1e-5)
    assert a.windows == 6 and a.predicted_tokens == 6 * (SEQ - 1) and a.tokens_from == "bytes"
    assert a.nll == pytest.approx(math.log(a.perplexity))


def test_uniform_model_has_perplexity_equal_to_the_vocabulary(tmp_path, text):
    # lm_head = 0: every logit is 0, the model predicts 1/V for every token, so exp(NLL) = V.
    make_llama(str(tmp_path), zero_head=True)
    res = evaluate_dir(str(tmp_path), text, SEQ)
    assert res.windows == res.available_windows > 10
    assert res.perplexity == pytest.approx(VOCAB, rel=1e-6)


def test_perplexity_matches_a_direct_computation(llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    ids = torch.randint(0, VOCAB, (3 * SEQ + 5,), generator=torch.Generator().manual_seed(0))
    res = perplexity(model, ids, SEQ)
    total = 0.0
    with torch.no_grad():
        for w in range(3):  # windows 0, 1, 2; the 5 trailing tokens are dropped
            x = ids[w * SEQ:(w + 1) * SEQ][None]
            total += float(torch.nn.functional.cross_entropy(model(x).logits[0, :-1], x[0, 1:], reduction="sum"))
    assert res.windows == 3 and res.predicted_tokens == 3 * (SEQ - 1)
    assert res.perplexity == pytest.approx(math.exp(total / (3 * (SEQ - 1))), rel=1e-5)


def test_progress_bar_when_asked(llama, capsys):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama).eval()
    ids = torch.randint(0, VOCAB, (4 * SEQ,), generator=torch.Generator().manual_seed(0))
    perplexity(model, ids, SEQ, progress=True)
    err = capsys.readouterr().err
    assert "perplexity: 100%" in err and "4/4" in err and "window" in err
    perplexity(model, ids, SEQ, progress=None)  # None: only on a terminal, and capsys is none
    assert capsys.readouterr().err == ""


def test_window_selection():
    assert window_starts(1000, 100) == ([i * 100 for i in range(10)], 10)
    assert window_starts(1099, 100, 3) == ([0, 300, 600], 10)  # floor(i * 10 / 3) = 0, 3, 6
    assert window_starts(1000, 100, 50) == ([i * 100 for i in range(10)], 10)
    with pytest.raises(EvalInputError, match="fewer than one window"):
        window_starts(99, 100)
    with pytest.raises(EvalInputError, match="at least 2"):
        window_starts(1000, 1)
    with pytest.raises(EvalInputError, match="max-windows"):
        window_starts(1000, 10, 0)


def test_escha_model_and_precision_option(llama, text, tmp_path, monkeypatch):
    from escha.cli import main as cli_main
    from escha.nn import EschaLinear
    out = str(tmp_path / "q")
    assert cli_main(["quantize", llama, out, "--bits", "2", "--encoder", "greedy", "--no-hessian",
                     "--seq-len", "48", "--samples", "8", "--quiet"]) == 0
    ref = evaluate_dir(llama, text, SEQ, max_windows=4)
    res = run_cli(out, "--text", text, "--seq-len", str(SEQ), "--max-windows", "4", "--json")
    assert res.returncode == 0, res.stderr
    q = json.loads(res.stdout)
    assert math.isfinite(q["perplexity"]) and q["perplexity"] != ref.perplexity
    # In process, on the reference path (the kernels would run in Triton's slow interpreter).
    from escha.nn import set_matmul_path
    model, _ = evaluate.load_for_eval(out)
    set_matmul_path(model, "reference")
    ids, _ = evaluate.encode_text(evaluate.read_text(text), None, VOCAB)
    assert perplexity(model, ids, SEQ, max_windows=4).perplexity == pytest.approx(q["perplexity"], rel=1e-5)
    model, _ = evaluate.load_for_eval(out, precision="bf16")
    linears = [m for m in model.modules() if isinstance(m, EschaLinear)]
    assert len(linears) == 14 and {m.precision for m in linears} == {"bf16"}
    # The attribute reaches escha.matmul as its precision argument.
    import escha.ops as ops
    seen = []
    real = ops.matmul
    monkeypatch.setattr(ops, "matmul", lambda x, qw, *a, **k: seen.append(k.get("precision")) or real(x, qw, *a, **k))
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long))
    assert seen and set(seen) == {"bf16"}
    default, _ = evaluate.load_for_eval(out)
    assert {m.precision for m in default.modules() if isinstance(m, EschaLinear)} == {None}
    with pytest.raises(EvalInputError, match="precision"):
        evaluate.load_for_eval(out, precision="fp4")


def test_cli_json(llama, text):
    res = run_cli(llama, "--text", text, "--seq-len", str(SEQ), "--max-windows", "5", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    want = evaluate_dir(llama, text, SEQ, max_windows=5)
    assert data["perplexity"] == pytest.approx(want.perplexity, rel=1e-6)
    assert data["windows"] == 5 and data["seq_len"] == SEQ and data["tokens_from"] == "bytes"
    assert "perplexity" not in res.stderr  # no progress bar when stderr is not a terminal
    assert data["device"] == "cpu"  # the default without a GPU


@pytest.mark.parametrize("case, message", [
    ("missing_dir", "model directory not found"),
    ("missing_text", "text file not found"),
    ("short_text", "fewer than one window of --seq-len 64"),
    ("bad_seq_len", "--seq-len must be at least 2"),
    ("too_long", "exceeds the model's 128 positions"),
    ("bad_device", "--device 'gpu0' is not a device; use cpu, cuda or cuda:N"),
    ("config_list", "config.json must hold a JSON object, got a list"),
])  # a truncated checkpoint and --device cuda without CUDA: tests/test_quantize_cli.py
def test_cli_errors(llama, text, tmp_path, case, message):
    short = tmp_path / "short.txt"
    short.write_text("too short", encoding="utf-8")
    (tmp_path / "listcfg").mkdir()
    (tmp_path / "listcfg" / "config.json").write_text("[1, 2]", encoding="utf-8")
    args = {"missing_dir": [str(tmp_path / "nope"), "--text", text],
            "missing_text": [llama, "--text", str(tmp_path / "nope.txt")],
            "short_text": [llama, "--text", str(short), "--seq-len", "64"],
            "bad_seq_len": [llama, "--text", text, "--seq-len", "1"],
            "too_long": [llama, "--text", text, "--seq-len", "256"],
            "bad_device": [llama, "--text", text, "--device", "gpu0"],
            "config_list": [str(tmp_path / "listcfg"), "--text", text]}[case]
    res = run_cli(*args)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("escha eval: error: ") and message in lines[-1], res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
