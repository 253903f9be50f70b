"""The model pipeline end to end on a tiny random Qwen3 checkpoint: CLI, reload, resume, errors."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from escha.cli import main as cli_main  # noqa: E402
from escha.io import load_file  # noqa: E402
from escha.model import (LinearStats, ModelError, QuantizeOptions, UnsupportedModelError,  # noqa: E402
                         load_model, quantize_model, quantize_module)
from escha.model import engine, pipeline  # noqa: E402
from escha.model.allocate import allocate_bits, mean_bits  # noqa: E402
from escha.nn import set_matmul_path  # noqa: E402

# The greedy encoder without LDLQ keeps the CPU run to seconds; the pipeline is what is tested.
FAST = ["--encoder", "greedy", "--no-hessian", "--seq-len", "48", "--quiet"]
FAST_OPTS = dict(encoder="greedy", use_hessian=False, seq_len=48, progress=False)
N_LINEARS = 14  # 2 layers x (q, k, v, o, gate, up, down)


def make_tiny(path, shard: bool = True, tie: bool = False):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   vocab_size=256, max_position_embeddings=256, tie_word_embeddings=tie)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    model.save_pretrained(path, max_shard_size="60KB" if shard else "1GB")
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny(path)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))  # sharded on purpose
    return path


@pytest.fixture(scope="module")
def quantized(tiny, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("q") / "out")
    assert cli_main(["quantize", tiny, out, "--bits", "2", *FAST]) == 0
    return out


PROMPT = torch.tensor([[3, 17, 99, 42, 7, 128]])


def greedy(model, n=12):
    set_matmul_path(model, "reference")  # fp32 math everywhere: the test compares weights, not kernels
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=n, do_sample=False, min_new_tokens=n)[0, PROMPT.shape[1]:]


def test_reloaded_model_generates_like_the_in_memory_one(tiny, quantized):
    """The directory the CLI wrote, loaded, equals the model quantized in memory: tokens, weights
    and logits; both differ from the unquantized model."""
    fp = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    mem = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    report = quantize_module(mem, QuantizeOptions(bits=2, **FAST_OPTS))
    assert len(report.stats) == N_LINEARS
    assert report.hessian.startswith("off") and all(s.hessian == "off" for s in report.stats)
    mem_tokens = greedy(mem)
    loaded = load_model(quantized, device="cpu")  # compared with models on the CPU
    assert type(loaded).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(greedy(loaded), mem_tokens)
    # Same weights, not only the same tokens: the streaming path equals the in-memory one.
    a, b = mem.state_dict(), loaded.state_dict()
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Quantization changed the function: logits differ from the original model's.
    with torch.no_grad():
        assert not torch.allclose(fp(PROMPT).logits, loaded(PROMPT).logits, atol=1e-3)
        assert torch.equal(mem(PROMPT).logits, loaded(PROMPT).logits)


def test_output_directory_layout(tiny, quantized):
    cfg = json.load(open(os.path.join(quantized, "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "escha" and qc["bits"] == 2 and qc["bpw"] == 2.0
    assert qc["modules_to_not_convert"] == ["lm_head"]
    assert len(qc["bits_map"]) == N_LINEARS and set(qc["bits_map"].values()) == {2}
    assert "lm_head" not in qc["bits_map"] and qc["storage_bpw"] > 2.0
    index = json.load(open(os.path.join(quantized, "model.safetensors.index.json")))["weight_map"]
    assert index["model.layers.1.mlp.down_proj.trellis"] == "model-00003-of-00003.safetensors"
    shell = load_file(os.path.join(quantized, "model-00001-of-00003.safetensors"))
    assert shell["lm_head.weight"].dtype == torch.float32 and shell["lm_head.weight"].shape == (256, 64)
    layer0 = load_file(os.path.join(quantized, "model-00002-of-00003.safetensors"))
    q = layer0["model.layers.0.self_attn.q_proj"]
    assert q.bits == 2 and q.shape == (64, 64)
    assert "model.layers.0.input_layernorm.weight" in layer0
    report = json.load(open(os.path.join(quantized, "escha_report.json")))
    assert [r["layer"] for r in report["layers"]] == [0, 1]
    assert all(0 < lin["proxy_rel"]["2"] < 2 for lin in report["linears"])
    assert not os.path.exists(os.path.join(quantized, ".partial"))
    assert os.path.isfile(os.path.join(quantized, "generation_config.json"))


def test_resume_after_interruption(tiny, quantized, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    real = pipeline.quantize_linears
    calls = []

    def interrupted(linears, hessians, layer, *a, **k):
        calls.append(layer)
        if layer == 1:
            raise KeyboardInterrupt("simulated interruption")
        return real(linears, hessians, layer, *a, **k)

    monkeypatch.setattr(pipeline, "quantize_linears", interrupted)
    opts = QuantizeOptions(bits=2, **FAST_OPTS)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny, out, opts)
    assert calls == [0, 1]
    assert os.path.isfile(os.path.join(out, ".partial", "layer_00000.safetensors"))
    assert not os.path.exists(os.path.join(out, "config.json"))

    calls.clear()
    monkeypatch.setattr(pipeline, "quantize_linears",
                        lambda linears, hessians, layer, *a, **k: (calls.append(layer), real(linears, hessians, layer, *a, **k))[1])
    report = quantize_model(tiny, out, opts)
    assert calls == [1]  # layer 0 came from its checkpoint
    assert report.resumed_layers == [0]
    shards = sorted(f for f in os.listdir(quantized) if f.endswith(".safetensors"))
    assert len(shards) == 3
    for shard in shards:  # byte for byte what the uninterrupted run (the CLI's) wrote
        with open(os.path.join(quantized, shard), "rb") as a, open(os.path.join(out, shard), "rb") as b:
            assert a.read() == b.read(), shard


def test_progress_counts_tiles_and_resumed_layers_leave_the_total(tiny, tmp_path, monkeypatch, capsys):
    out = str(tmp_path / "out")
    opts = QuantizeOptions(bits=2, **{**FAST_OPTS, "progress": True})
    real = pipeline.quantize_linears

    def stop_at_layer_1(linears, hessians, layer, *a, **k):
        if layer == 1:
            raise KeyboardInterrupt
        return real(linears, hessians, layer, *a, **k)

    monkeypatch.setattr(pipeline, "quantize_linears", stop_at_layer_1)
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny, out, opts)
    # Per layer: q, k, v, o pad to 128 x 128 (64 tiles each), gate, up, down to 256 x 128 (128).
    err = capsys.readouterr().err
    assert "640/1280" in err and "tile" in err  # the bar is closed where the run stopped
    monkeypatch.setattr(pipeline, "quantize_linears", real)
    quantize_model(tiny, out, opts)
    err = capsys.readouterr().err
    assert "quantize: 100%" in err and "640/640" in err and "1 layer(s) resumed" in err


def test_partial_results_of_another_run_are_refused(tiny, tmp_path, monkeypatch):
    out = str(tmp_path / "out")
    monkeypatch.setattr(pipeline, "quantize_linears", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        quantize_model(tiny, out, QuantizeOptions(bits=2, **FAST_OPTS))
    with pytest.raises(ModelError, match="different run.*seed"):
        quantize_model(tiny, out, QuantizeOptions(bits=2, seed=1, **FAST_OPTS))


def test_bpw_allocation_end_to_end(tiny, tmp_path):
    out = str(tmp_path / "out")
    report = quantize_model(tiny, out, QuantizeOptions(bpw=2.5, **FAST_OPTS))
    bits = report.bits_map
    assert set(bits.values()) == {2, 3}
    assert 2.0 < report.mean_bits <= 2.5
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["bits_map"] == bits and qc["bits"] is None and abs(qc["bpw"] - report.mean_bits) < 1e-3
    model = load_model(out)
    for name, k in bits.items():
        assert model.get_submodule(name).qweight.bits == k
    # K=3 lowers every Linear's measured error.
    assert all(s.proxy[3] < s.proxy[2] for s in report.stats)


def _stat(name, params, l2, l3):
    s = LinearStats(name, 0, (params, 1))
    s.proxy = {2: l2, 3: l3}
    return s


def test_allocate_bits_is_greedy_by_gain_per_bit():
    stats = [_stat("a", 100, 10.0, 1.0),   # gain 0.09 per bit
             _stat("b", 100, 2.0, 1.9),    # gain 0.001
             _stat("c", 50, 5.0, 1.0),     # gain 0.08
             _stat("d", 250, 30.0, 5.0)]   # gain 0.1, but too big for the budget
    choice = allocate_bits(stats, 2.4)  # 0.4 * 500 = 200 extra bits
    assert choice == {"a": 3, "b": 2, "c": 3, "d": 2}
    assert mean_bits(stats, choice) == pytest.approx(2.3)
    assert allocate_bits(stats, 3.0) == {"a": 3, "b": 3, "c": 3, "d": 3}
    assert set(allocate_bits(stats, 2.0).values()) == {2}


def test_allocate_bits_gives_a_shared_input_one_k():
    """q and k quantized together are one unit: upgraded together (gains and sizes summed), or not."""
    q, k, o = _stat("q", 100, 10.0, 1.0), _stat("k", 100, 2.0, 1.9), _stat("o", 150, 8.0, 2.0)
    q.shared_input = k.shared_input = "q"
    # Unit [q, k]: gain (9 + 0.1) / 200 = 0.0455 per bit; o: 6 / 150 = 0.04. Budget 200 extra bits.
    assert allocate_bits([q, k, o], (2 * 350 + 200) / 350) == {"q": 3, "k": 3, "o": 2}
    # Budget for o alone (150 bits) but not for the pair: o is upgraded, the pair stays together.
    assert allocate_bits([q, k, o], (2 * 350 + 150) / 350) == {"q": 2, "k": 2, "o": 3}


def test_hessian_reaches_the_encoder(tiny, monkeypatch):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    seen = {}
    real, real_shared = engine.quant.quantize, engine.quant.quantize_shared

    def spy(w, bits, hessian=None, seed=0, **kw):
        seen.setdefault(w.shape, hessian)
        return real(w, bits=bits, hessian=None, seed=seed, encoder="greedy")

    def spy_shared(ws, bits, hessian=None, seed=0, **kw):  # q, k, v read one input: quantized together
        seen.setdefault(tuple(tuple(w.shape) for w in ws), hessian)
        return real_shared(ws, bits=bits, hessian=None, seed=seed, encoder="greedy")

    monkeypatch.setattr(engine.quant, "quantize", spy)
    monkeypatch.setattr(engine.quant, "quantize_shared", spy_shared)
    # Reference Hessian of layer 0's q_proj from the unquantized model on the same samples.
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny).eval()
    xs = []
    h = ref_model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: xs.append(a[0].reshape(-1, 64)))
    from escha.model.calib import read_calibration, tokenize
    toks = tokenize(read_calibration(None), None, 256, True, 48, QuantizeOptions().max_samples)
    with torch.no_grad():
        for ids in toks.samples:
            ref_model(ids)
    h.remove()
    x = torch.cat(xs).float()
    want = x.T @ x / x.shape[0]
    report = quantize_module(model, QuantizeOptions(bits=2, seq_len=48, progress=False))
    qkv = next(k for k in seen if isinstance(k[0], tuple) and k[0] == (64, 64))  # layer 0's [q, k, v]
    assert len(qkv) == 3
    got = seen[qkv]
    assert got is not None and got.shape == (64, 64)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    assert report.hessian.startswith("used") and all(s.hessian == "used" for s in report.stats)


# -- bad input --------------------------------------------------------------------------------
def test_missing_model_dir_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        quantize_model(str(tmp_path / "nope"), str(tmp_path / "out"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        quantize_model(str(tmp_path / "empty"), str(tmp_path / "out"))


def test_missing_shard(tiny, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    shard = json.load(open(bad / "model.safetensors.index.json"))["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    os.unlink(bad / shard)
    with pytest.raises(FileNotFoundError, match=f"missing: .*{shard}"):
        quantize_model(str(bad), str(tmp_path / "out"))


def test_non_2d_weight_and_missing_tensor(tmp_path):
    from safetensors.torch import load_file as st_load, save_file as st_save
    src = tmp_path / "src"
    make_tiny(str(src), shard=False)
    tensors = st_load(str(src / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"].reshape(64, 8, 8)
    st_save(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"q_proj.weight' has shape \[64, 8, 8\] but the model expects \[64, 64\]"):
        quantize_model(str(src), str(tmp_path / "out"), QuantizeOptions(**FAST_OPTS))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    st_save(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match="no tensor for 'model.layers.0.self_attn.q_proj.weight'"):
        quantize_model(str(src), str(tmp_path / "out"), QuantizeOptions(**FAST_OPTS))


def test_unsupported_architecture_and_options(tiny, tmp_path):
    import shutil
    bad = tmp_path / "arch"
    shutil.copytree(tiny, bad)
    cfg = json.load(open(bad / "config.json"))
    cfg["architectures"] = ["FooBarForCausalLM"]
    json.dump(cfg, open(bad / "config.json", "w"))
    with pytest.raises(UnsupportedModelError, match="FooBarForCausalLM"):
        quantize_model(str(bad), str(tmp_path / "out"))
    with pytest.raises(ModelError, match="--bpw must lie in"):
        QuantizeOptions(bpw=1.5)
    with pytest.raises(ModelError, match="--bits must be one of"):
        QuantizeOptions(bits=4)


def test_cli_reports_errors_and_refuses_a_full_out_dir(tiny, quantized, tmp_path, capsys):
    assert cli_main(["quantize", str(tmp_path / "missing"), str(tmp_path / "o"), *FAST]) == 2
    assert "model directory not found" in capsys.readouterr().err
    assert cli_main(["quantize", tiny, quantized, *FAST]) == 2
    assert "is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["quantize", tiny, str(tmp_path / "o"), "--bits", "2", "--bpw", "2.5"])


def test_option_types_are_checked_and_a_skip_string_is_one_pattern(tiny):
    opts = QuantizeOptions(skip="lm_head", **FAST_OPTS)
    assert opts.skip == ("lm_head",)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    names = [n for n, _ in pipeline.quantization_targets(model, opts)]
    assert len(names) == N_LINEARS and "lm_head" not in names
    assert QuantizeOptions(skip=["lm_head", "*.q_proj"]).skip == ("lm_head", "*.q_proj")
    with pytest.raises(TypeError, match="^skip must be a module name or a tuple"):
        QuantizeOptions(skip=None)
    for listed in ("lm_head,*.q_proj", ["lm_head", "a,b"]):  # matched nothing before: quantized silently
        with pytest.raises(ValueError, match="^skip patterns name modules, which hold no commas"):
            QuantizeOptions(skip=listed)
    with pytest.raises(TypeError, match=r"^bpw must be a number or None, got '2.5' \(str\)$"):
        QuantizeOptions(bpw="2.5")
    with pytest.raises(TypeError, match=r"^seq_len must be an int, got '2' \(str\)$"):
        QuantizeOptions(seq_len="2")
    with pytest.raises(TypeError, match="^max_samples must be an int, got 8.0"):
        QuantizeOptions(max_samples=8.0)


def test_options_must_be_quantize_options(tiny, tmp_path):
    with pytest.raises(TypeError, match="^options must be a QuantizeOptions .*got dict$"):
        quantize_model(tiny, str(tmp_path / "out"), {"bits": 2})
    assert not (tmp_path / "out").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    with pytest.raises(TypeError, match="^options must be a QuantizeOptions"):
        quantize_module(model, {"bits": 2})


def test_load_model_dtype(quantized):
    model = load_model(quantized, device="cpu", dtype="bfloat16")  # a name, as QuantizeOptions.dtype takes
    assert model.lm_head.weight.dtype == torch.bfloat16
    with pytest.raises(ModelError, match="^dtype must be a floating dtype, got torch.int8$"):
        load_model(quantized, dtype=torch.int8)
    with pytest.raises(ModelError, match="^dtype must name a torch floating dtype .*got 'float17'$"):
        load_model(quantized, dtype="float17")
    with pytest.raises(TypeError, match="^dtype must be a torch.dtype, .* got int$"):
        load_model(quantized, dtype=16)


def _broken_copy(quantized, tmp_path, name, edit):
    import shutil
    d = tmp_path / name
    shutil.copytree(quantized, d)
    edit(d)
    return str(d)


def _set_bits(value):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"]["bits_map"]["model.layers.0.self_attn.q_proj"] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


@pytest.mark.parametrize("case, error, message", [
    ("bad_json", ModelError, r"config.json is not valid JSON \(Expecting"),
    ("json_list", ModelError, "config.json must hold a JSON object, got a list"),
    ("no_weight_map", ModelError, 'model.safetensors.index.json has no "weight_map" object'),
    ("bits_text", ModelError, r"bits_map\['model.layers.0.self_attn.q_proj'\]: bits must be one of .*got 'x'"),
    ("bits_7", ModelError, r"bits_map\['model.layers.0.self_attn.q_proj'\]: bits must be one of .*got 7"),
])
def test_load_model_names_what_is_wrong_with_the_directory(quantized, tmp_path, case, error, message):
    edit = {"bad_json": lambda d: (d / "config.json").write_text("{not json"),
            "json_list": lambda d: (d / "config.json").write_text("[1, 2]"),
            "no_weight_map": lambda d: (d / "model.safetensors.index.json").write_text("{}"),
            "bits_text": _set_bits("x"),
            "bits_7": _set_bits(7)}[case]
    with pytest.raises(error, match=message) as e:
        load_model(_broken_copy(quantized, tmp_path, case, edit), device="cpu")
    assert str(tmp_path / case) in str(e.value) and "\n" not in str(e.value)


def test_load_model_on_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="^model directory not found: .*nope$"):
        load_model(str(tmp_path / "nope"))


def test_out_dir_that_is_a_file(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match=f"^OUT_DIR {tmp_path / 'file'} exists and is not a directory"):
        quantize_model(tiny, str(tmp_path / "file"), QuantizeOptions(**FAST_OPTS))


@pytest.mark.parametrize("case, message", [
    ("empty", "holds no text"),
    ("blank", "holds no text"),
    ("latin1", r"is not UTF-8 text \(byte 3: invalid continuation byte\)"),
    ("directory", "is a directory; expected a UTF-8 text file"),
])
def test_calibration_file_is_checked_before_the_weights_load(tiny, tmp_path, monkeypatch, case, message):
    path = tmp_path / case
    if case == "directory":
        path.mkdir()
    else:
        path.write_bytes({"empty": b"", "blank": b" \n\n\t\n", "latin1": "café au lait".encode("latin-1")}[case])

    def load_tensors(*a, **k):
        raise AssertionError("the checkpoint's weights were loaded before the calibration file was read")

    monkeypatch.setattr(pipeline, "load_tensors", load_tensors)
    with pytest.raises(ModelError, match=f"^calibration file {path} {message}"):
        quantize_model(tiny, str(tmp_path / "out"), QuantizeOptions(calib=str(path), **FAST_OPTS))
    assert not (tmp_path / "out").exists()
