"""`escha quantize` as a user runs it: one-line errors with exit status 2 (in a subprocess, as a
shell sees them), Ctrl-C and resume, --skip, --help, the closing summary and the slow-run note."""
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from escha.cli import main as cli_main  # noqa: E402
from escha.progress import format_bytes  # noqa: E402
from test_model import FAST, make_tiny  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
       "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def escha(*args: str, code: str | None = None) -> subprocess.CompletedProcess:
    """``escha ARGS`` in a new process; with ``code``, that Python first (then the same command)."""
    prog = ("import sys\n" + (code or "") + "\nfrom escha.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, env=ENV,
                          cwd=ROOT, timeout=300)


def assert_one_line_error(res: subprocess.CompletedProcess, *parts: str, status: int = 2) -> str:
    assert res.returncode == status, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, res.stderr
    for p in parts:
        assert p in lines[0], res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A tiny Qwen3 checkpoint in one model.safetensors file."""
    path = tmp_path_factory.mktemp("single") / "model"
    make_tiny(str(path), shard=False)
    return path


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    """FAST with a short calibration text: a new process then need not read the shipped corpus."""
    from escha.model.calib import BUILTIN_TEXT
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("\n\n".join(BUILTIN_TEXT), encoding="utf-8")
    return [*FAST, "--calib", str(calib)]


@pytest.fixture(scope="module")
def whole(single, fast, tmp_path_factory):
    """An uninterrupted run, not quiet: (output directory, what it printed)."""
    out = tmp_path_factory.mktemp("whole") / "out"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["quantize", str(single), str(out), "--bits", "2", *[a for a in fast if a != "--quiet"]]) == 0
    return out, buf.getvalue()


# Ctrl-C arrives while layer 1 is being quantized: a real SIGINT, sent by the process to itself.
INTERRUPT_AT_LAYER_1 = """
import os, signal
# Python raises KeyboardInterrupt on SIGINT only where it started with SIGINT handled; a
# background job of a non-interactive shell starts with it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from escha.model import pipeline
real = pipeline.quantize_linears
def interrupted(linears, hessians, layer, *a, **k):
    if layer == 1:
        os.kill(os.getpid(), signal.SIGINT)
    return real(linears, hessians, layer, *a, **k)
pipeline.quantize_linears = interrupted
"""
# Ctrl-C while the scales are being tuned, after the model was written.
INTERRUPT_IN_TUNING = """
import os, signal
signal.signal(signal.SIGINT, signal.default_int_handler)
from escha.model import pipeline
def interrupted(*a, **k):
    os.kill(os.getpid(), signal.SIGINT)
pipeline.tune_directory = interrupted
"""
CPU_ONLY = torch.version.cuda is None and torch.version.hip is None


@pytest.fixture(scope="module")
def runs(single, fast, tmp_path_factory):
    """Every command-line error case, run in its own process, the processes side by side (each
    spends most of its time importing): {case: (CompletedProcess, the directories involved)}."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import load_file as st_load, save_file as st_save
    root = tmp_path_factory.mktemp("errors")

    def bad_copy(name, write):
        d = root / name
        shutil.copytree(single, d)
        write(d / "model.safetensors")
        return d

    data = (single / "model.safetensors").read_bytes()
    cut = bad_copy("cut", lambda f: f.write_bytes(data[:len(data) // 2]))
    noise = bad_copy("noise", lambda f: f.write_bytes(os.urandom(4096)))
    tensors = st_load(str(single / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][5, 9] = float("nan")
    nan = bad_copy("nan", lambda f: st_save(tensors, str(f), metadata={"format": "pt"}))
    text = root / "eval.txt"
    text.write_text("calibration " * 400, encoding="utf-8")
    out = lambda name: str(root / f"out-{name}")  # noqa: E731
    (root / "out-out_is_file").write_text("not a directory", encoding="utf-8")
    (root / "calib-empty.txt").write_bytes(b"")
    (root / "calib-latin1.txt").write_bytes("déjà vu".encode("latin-1"))
    (root / "calib-dir").mkdir()
    calib = lambda name: [*fast, "--calib", str(root / name)]  # noqa: E731 (the last --calib wins)
    cases = {
        "out_is_file": (["quantize", str(single), out("out_is_file"), *fast], None, None),
        "calib_empty": (["quantize", str(single), out("calib_empty"), *calib("calib-empty.txt")], None, None),
        "calib_latin1": (["quantize", str(single), out("calib_latin1"), *calib("calib-latin1.txt")], None, None),
        "calib_dir": (["quantize", str(single), out("calib_dir"), *calib("calib-dir")], None, None),
        "truncated": (["quantize", str(cut), out("cut"), *fast], None, cut),
        "random": (["quantize", str(noise), out("noise"), *fast], None, noise),
        "nan": (["quantize", str(nan), out("nan"), *fast], None, nan),
        "gpu": (["quantize", str(single), out("gpu"), "--device", "gpu", *fast], None, None),
        "ctrl_c": (["quantize", str(single), out("ctrl_c"), "--bits", "2", *fast], INTERRUPT_AT_LAYER_1, None),
        "eval_truncated": (["eval", str(cut), "--text", str(text)], None, cut),
        "ctrl_c_tune": (["quantize", str(single), out("ctrl_c_tune"), "--bits", "2", "--tune-steps", "4", *fast],
                        INTERRUPT_IN_TUNING, None),
    }
    if CPU_ONLY:
        cases["cuda"] = (["quantize", str(single), out("cuda"), "--device", "cuda", *fast], None, None)
        cases["eval_cuda"] = (["eval", str(single), "--text", str(text), "--device", "cuda"], None, None)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(escha, *args, code=code) for k, (args, code, _) in cases.items()}
        return {k: (f.result(), cases[k][2], root / f"out-{k}") for k, f in futures.items()}


def test_truncated_safetensors_is_named(runs):
    for case, prog in (("truncated", "escha quantize"), ("eval_truncated", "escha eval")):
        res, bad, _ = runs[case]
        line = assert_one_line_error(res, f"{prog}: error: {bad / 'model.safetensors'}: ", "truncated")
        assert "tensor data ends at byte" in line


def test_random_bytes_safetensors_is_named(runs):
    res, bad, _ = runs["random"]
    assert_one_line_error(res, f"escha quantize: error: {bad / 'model.safetensors'}: ", "not a safetensors file")


def test_nan_in_checkpoint_names_the_tensor(runs):
    res, bad, _ = runs["nan"]
    assert_one_line_error(res, f"escha quantize: error: {bad / 'model.safetensors'}: ",
                          "tensor 'model.layers.1.mlp.down_proj.weight'", "NaN at [5, 9]")


@pytest.mark.skipif(not CPU_ONLY, reason="this torch has CUDA")
def test_device_cuda_with_a_cpu_only_torch(runs, single):
    for case, prog in (("cuda", "escha quantize"), ("eval_cuda", "escha eval")):
        assert_one_line_error(runs[case][0], f"{prog}: error: --device cuda: this torch", "was built without CUDA")
    from escha.devices import DeviceError
    from escha.model import load_model
    with pytest.raises(DeviceError, match="was built without CUDA") as e:
        load_model(str(single), device="cuda")
    assert "\n" not in str(e.value)


def test_out_dir_that_is_a_file(runs):
    res, _, out = runs["out_is_file"]
    assert_one_line_error(res, f"escha quantize: error: OUT_DIR {out} exists and is not a directory")


@pytest.mark.parametrize("case, message", [
    ("calib_empty", "calib-empty.txt holds no text"),
    ("calib_latin1", "calib-latin1.txt is not UTF-8 text (byte 1: invalid continuation byte)"),
    ("calib_dir", "calib-dir is a directory; expected a UTF-8 text file"),
])
def test_bad_calibration_file(runs, case, message):
    res, _, out = runs[case]
    assert_one_line_error(res, f"escha quantize: error: calibration file {out.parent}", message)
    assert not out.exists()  # refused before any work


def test_device_that_does_not_exist(runs):
    assert_one_line_error(runs["gpu"][0],
                          "escha quantize: error: --device 'gpu' is not a device; use cpu, cuda or cuda:N")


def test_ctrl_c_while_tuning_says_the_model_is_there_untuned(runs, whole):
    res, _, out = runs["ctrl_c_tune"]
    assert_one_line_error(res, f"escha quantize: interrupted: {out} holds the quantized model, complete",
                          "--overwrite", status=130)
    ref = whole[0]
    for f in sorted(f for f in os.listdir(ref) if f.endswith(".safetensors")):  # as written before tuning
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f


def test_ctrl_c_says_how_to_resume_and_the_rerun_gives_the_same_bytes(runs, single, fast, whole):
    res, _, out = runs["ctrl_c"]
    line = assert_one_line_error(res, "escha quantize: interrupted: 1 finished layer(s) are kept in",
                                 "run the same command again to resume", status=130)
    assert str(out / ".partial") in line
    assert not (out / "config.json").exists()
    assert cli_main(["quantize", str(single), str(out), "--bits", "2", *fast]) == 0
    report = json.loads((out / "escha_report.json").read_text())
    assert report["resumed_layers"] == [0]
    ref = whole[0]
    shards = sorted(f for f in os.listdir(ref) if f.endswith(".safetensors"))
    assert len(shards) == 3
    for f in shards:  # the same bytes as the uninterrupted run's, not only the same tensors
        assert (out / f).read_bytes() == (ref / f).read_bytes(), f


def test_an_interrupted_assembly_resumes(single, fast, tmp_path, monkeypatch):
    """Ctrl-C while the shards are written (after every layer is done) leaves a directory that a
    rerun completes, without --overwrite."""
    from escha.model import output
    out = tmp_path / "out"
    real, calls = output.save_file, []

    def save_then_stop(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(tensors, path, metadata)

    monkeypatch.setattr(output, "save_file", save_then_stop)
    assert cli_main(["quantize", str(single), str(out), *fast]) == 130
    assert (out / "model-00001-of-00003.safetensors").exists() and not (out / "config.json").exists()
    monkeypatch.setattr(output, "save_file", real)
    assert cli_main(["quantize", str(single), str(out), *fast]) == 0
    assert (out / "config.json").exists() and not (out / ".partial").exists()


def test_skip_adds_to_lm_head_and_reports_patterns_that_match_nothing(single, fast, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["quantize", str(single), str(out), "--skip", "nomatch.*,*.q_proj", *fast]) == 0
    err = capsys.readouterr().err
    assert "escha quantize: warning: skip pattern 'nomatch.*' matches no Linear of Qwen3ForCausalLM" in err
    assert "'*.q_proj'" not in err and err.count("warning:") == 1
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["lm_head", "nomatch.*", "*.q_proj"]
    assert "lm_head" not in qc["bits_map"] and not any(n.endswith("q_proj") for n in qc["bits_map"])
    assert len(qc["bits_map"]) == 12  # 14 Linears less the two q_proj
    head = tmp_path / "head"
    assert cli_main(["quantize", str(single), str(head), "--quantize-lm-head", *fast]) == 0
    qc = json.loads((head / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == [] and qc["bits_map"]["lm_head"] == 2


def test_bad_encoder_option_lists_the_valid_ones():
    from escha.model import ModelError, QuantizeOptions
    with pytest.raises(ModelError, match="^encoder must be one of viterbi, greedy; got 'fast'$"):
        QuantizeOptions(encoder="fast")


@pytest.mark.parametrize("command, defaults", [
    ("quantize", ["(default 0)", "(default: cuda when torch sees a GPU, else cpu)", "(default 2048",
                  "(default 128"]),
    ("eval", ["(default: cuda when torch sees a GPU, else cpu)", "(default 2048)"]),
])
def test_help_shows_defaults(capsys, command, defaults):
    with pytest.raises(SystemExit) as e:
        cli_main([command, "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for d in defaults:
        assert d in text, d


def test_summary_sizes_ratio_and_bits_per_weight(single, whole):
    out, text = whole
    report = json.loads((out / "escha_report.json").read_text())
    in_bytes = os.path.getsize(single / "model.safetensors")
    out_bytes = sum(os.path.getsize(out / f) for f in os.listdir(out) if f.endswith(".safetensors"))
    assert report["input_bytes"] == in_bytes and report["output_bytes"] == out_bytes
    params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(single).parameters())
    assert report["checkpoint_params"] == params
    assert report["checkpoint_bpw"] == pytest.approx(8 * out_bytes / params)
    assert (f"input {format_bytes(in_bytes)}, output {format_bytes(out_bytes)}: "
            f"{in_bytes / out_bytes:.1f}x smaller") in text
    assert f"stored bits per weight: {report['storage_bpw']:.3f} over the 14 quantized Linears" in text
    assert f"stored bits per weight: {8 * out_bytes / params:.3f} over the whole checkpoint" in text
    # Its embeddings and head (2 x 256 x 64 float32) are over a quarter of its weights; its Linears
    # pad 64 to 128 (hence over 2 bits each, K=2).
    assert "higher because the other 28% of the parameters" in text and "stay as stored in the input" in text
    assert 2.0 < report["storage_bpw"] < report["checkpoint_bpw"]


def test_a_long_run_is_announced_before_it_starts(single, fast, tmp_path, monkeypatch, capsys):
    from escha.model import pipeline

    def stop(*a, **k):  # where calibration would start: the note must already be out
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "SLOW_SECONDS", 0.0)
    monkeypatch.setattr(pipeline, "capture_inputs", stop)
    viterbi = [a for a in fast if a not in ("--encoder", "greedy", "--quiet")]  # greedy: never announced
    assert cli_main(["quantize", str(single), str(tmp_path / "out"), *viterbi]) == 130
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("escha quantize: note: "), lines
    assert "encoding 14 Linears (" in lines[0] and "tiles at K=2) will take about" in lines[0]
    assert "on this CPU" in lines[0] and "an H200 takes" in lines[0] and "--device cuda" in lines[0]
    assert lines[1].startswith("escha quantize: interrupted: no layer was finished yet")


def test_a_long_gpu_run_is_announced_with_the_h200_rate(single, monkeypatch):
    from escha.model import QuantizeOptions, pipeline
    from escha.progress import SlowWorkWarning
    model = transformers.AutoModelForCausalLM.from_pretrained(single)
    linears = pipeline.quantization_targets(model, QuantizeOptions(device="cpu"))
    opts = QuantizeOptions(bpw=2.5, device="cpu")
    with pytest.warns(SlowWorkWarning, match=r"^encoding 14 Linears \(1,280 tiles at K=2/3\) will take about "
                                            r".* at the H200's measured rate \(other GPUs differ\)"):
        monkeypatch.setattr(pipeline, "GPU_SLOW_SECONDS", 0.0)
        pipeline._notice_if_slow(linears, opts, torch.device("cuda"))  # an estimate: no GPU is used
    monkeypatch.setattr(pipeline, "GPU_SLOW_SECONDS", 600.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowWorkWarning)
        pipeline._notice_if_slow(linears, opts, torch.device("cuda"))  # a second or so: no note
