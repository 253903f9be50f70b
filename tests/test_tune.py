"""Scale tuning (escha.model.tune, ``escha quantize --tune-steps``) on a tiny random Qwen3."""
import json
import os

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from escha.cli import main as cli_main  # noqa: E402
from escha.format.qweight import QuantizedWeight  # noqa: E402
from escha.io import load_file  # noqa: E402
from escha.model import ModelError, QuantizeOptions  # noqa: E402
from escha.model.loading import load_unfused  # noqa: E402
from escha.model.tune import (DEFAULT_STEPS, TuneOptions, _kl, memory_bytes, norm_modules, plan,  # noqa: E402
                              tune_scales)
from escha.nn.linear import EschaLinear  # noqa: E402
from test_model import FAST, FAST_OPTS, quantized, tiny  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    """A tiny Qwen3 whose next-token distributions are far from uniform (weights 10x the default
    init), quantized: its scales matter to its logits."""
    path = tmp_path_factory.mktemp("peaked")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
                                   initializer_range=0.2)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path / "model")
    assert cli_main(["quantize", str(path / "model"), str(path / "q"), "--bits", "2", *FAST]) == 0
    return str(path / "model"), str(path / "q")


def samples(n=6, length=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (1, length), generator=g) for _ in range(n)]


def scales(model):
    return {n: m.qweight.scale.clone() for n, m in model.named_modules() if isinstance(m, EschaLinear)}


def set_scales(model, new):
    for n, m in model.named_modules():
        if isinstance(m, EschaLinear):
            qw = m.qweight
            m.set_qweight(QuantizedWeight(qw.trellis, qw.su, qw.sv, new[n], qw.gscale, shape=qw.shape, bits=qw.bits))


def heldout_kl(student, teacher, ids):
    with torch.no_grad():
        return sum(float(_kl(student(input_ids=x).logits, teacher(input_ids=x).logits)) for x in ids) / len(ids)


@pytest.mark.parametrize("norms", [False, True])
def test_tuning_finds_scales_it_was_moved_from(peaked, norms):
    """Teacher: the quantized model itself; student: the same with every row scale moved by a
    random factor exp(N(0, 0.3^2)). The optimum is known (KL 0 at the stored scales): tuning must
    cut the KL several times and bring the scales back toward the stored ones."""
    from escha.nn import set_matmul_path
    teacher = load_unfused(peaked[1], "cpu", torch.float32).eval()
    set_matmul_path(teacher, "reference")
    student = load_unfused(peaked[1], "cpu", torch.float32)
    good = scales(student)
    g = torch.Generator().manual_seed(3)
    set_scales(student, {n: (c.float() * torch.exp(0.3 * torch.randn(c.shape, generator=g))).half()
                         for n, c in good.items()})

    def scale_error():
        return sum(float((s.float().log() - good[n].float().log()).abs().mean()) for n, s in scales(student).items())

    err0 = scale_error()
    norms_before = {n: m.weight.clone() for n, m in norm_modules(student)}
    ids = samples()
    res = tune_scales(student, teacher, ids, TuneOptions(steps=40, lr=2e-2, norms=norms), torch.device("cpu"))
    assert res.train_samples == 5 and res.heldout_samples == 1 and res.kept_step > 0
    assert res.kl_after < 0.25 * res.kl_before, res.curve
    assert scale_error() < 0.9 * err0
    # The model as the file would store it (fp16 scales, EschaLinear forward) has the KL the run kept.
    set_matmul_path(student, "reference")
    assert heldout_kl(student, teacher, ids[-1:]) == pytest.approx(res.kl_after, rel=0.05, abs=1e-3)
    moved = [not torch.equal(m.weight, norms_before[n]) for n, m in norm_modules(student)]
    assert any(moved) if norms else not any(moved)
    assert all(isinstance(m, EschaLinear) for n, m in student.named_modules() if n.endswith("proj"))


def test_zero_steps_and_no_gain_leave_the_model_as_it_was(peaked):
    teacher = transformers.AutoModelForCausalLM.from_pretrained(peaked[0]).eval()
    student = load_unfused(peaked[1], "cpu", torch.float32)
    before = scales(student)
    norms = {n: m.weight.clone() for n, m in norm_modules(student)}
    res = tune_scales(student, teacher, samples(), TuneOptions(steps=0), torch.device("cpu"))
    assert res.kept_step == 0 and res.kl_after == res.kl_before and res.curve == [(0, res.kl_before)]
    # The quantized model as its own teacher: it starts at the optimum (KL ~0), every step can only
    # do worse on the held-out sample, so nothing is kept.
    from escha.nn import set_matmul_path
    itself = load_unfused(peaked[1], "cpu", torch.float32).eval()
    set_matmul_path(itself, "reference")
    res = tune_scales(student, itself, samples(), TuneOptions(steps=3, lr=1e-2), torch.device("cpu"))
    assert res.kl_before < 1e-5
    assert res.kept_step == 0 and all(kl > res.kl_before for _, kl in res.curve[1:]), res.curve
    for n, c in scales(student).items():
        assert torch.equal(c, before[n]), n
    for n, m in norm_modules(student):
        assert torch.equal(m.weight, norms[n]), n
        assert not m.weight.requires_grad


def test_cli_writes_tuned_scales_and_norms_back(tiny, quantized, tmp_path):
    out = str(tmp_path / "tuned")
    assert cli_main(["quantize", tiny, out, "--bits", "2", "--tune-steps", "8", "--tune-lr", "1e-2", *FAST]) == 0
    with open(os.path.join(out, "escha_report.json")) as f:
        tune = json.load(f)["tune"]
    assert tune["steps"] == 8 and tune["kl_after"] <= tune["kl_before"]
    assert tune["scales"] > 0 and tune["norm_weights"] > 0
    plain, tuned = {}, {}
    for d, into in ((quantized, plain), (out, tuned)):
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                into.update(load_file(os.path.join(d, f)))
    assert plain.keys() == tuned.keys()
    changed = set()
    for k, a in plain.items():
        b = tuned[k]
        if isinstance(a, QuantizedWeight):  # codes, signs and global scale are the quantizer's
            for name in ("trellis", "su", "sv", "gscale"):
                assert torch.equal(getattr(a, name), getattr(b, name)), (k, name)
            if not torch.equal(a.scale, b.scale):
                changed.add(k)
        else:
            assert a.dtype == b.dtype and a.shape == b.shape, k
            if not torch.equal(a, b):
                changed.add(k)
    if tune["kept_step"]:
        assert any(k.endswith("proj") for k in changed) and any("norm" in k for k in changed), changed
        assert all(k.endswith("proj") or "norm" in k for k in changed), changed
    else:
        assert not changed
    from escha.model import load_model
    load_model(out, device="cpu")  # the rewritten shards load (validated)


def test_bad_tuning_settings_are_one_line_errors():
    with pytest.raises(ModelError, match="tune steps"):
        QuantizeOptions(bits=2, tune_steps=-1)
    with pytest.raises(ModelError, match="learning rate"):
        QuantizeOptions(bits=2, tune_steps=4, tune_lr=0.0)


def test_the_plan_tunes_by_default_on_a_gpu_where_it_fits_only():
    """The default: DEFAULT_STEPS on CUDA in the leanest-first choice that fits 80% of the free
    memory (the calibration dtype, then with gradient checkpointing, then bfloat16 with it);
    never on a CPU; given steps run anyway, in the leanest choice."""
    cuda, cpu, f32, bf16 = torch.device("cuda", 0), torch.device("cpu"), torch.float32, torch.bfloat16
    smollm = (134_515_008, f32, 2048, 49152, 30, 576, 9)  # measured peak 11.6 GiB at fp32, not checkpointed
    assert 11.6 * 2**30 < memory_bytes(*smollm) < 40 * 2**30
    p = plan(None, cuda, 139 * 2**30, *smollm)
    assert (p.steps, p.dtype, p.checkpointing) == (DEFAULT_STEPS, f32, False)
    assert plan(None, cuda, 16 * 2**30, *smollm).checkpointing and plan(None, cuda, 16 * 2**30, *smollm).steps
    assert plan(None, cuda, 2 * 2**30, *smollm).steps == 0
    assert plan(None, cpu, None, *smollm).steps == 0 and plan(64, cpu, None, *smollm).steps == 64
    qwen14 = (14_800_000_000, f32, 2048, 151936, 40, 5120, 40)
    p = plan(None, cuda, 139 * 2**30, *qwen14)  # fp32 copies (118 GB) leave too little: bf16, checkpointed
    assert (p.steps, p.dtype, p.checkpointing) == (DEFAULT_STEPS, bf16, True) and p.need_bytes < 0.8 * 139 * 2**30
    assert plan(None, cuda, 40 * 2**30, *qwen14).steps == 0
    forced = plan(32, cuda, 40 * 2**30, *qwen14)
    assert (forced.steps, forced.dtype, forced.checkpointing) == (32, bf16, True)
    assert memory_bytes(*qwen14, checkpointing=True) < memory_bytes(*qwen14)


def test_checkpointing_changes_memory_not_the_result(peaked):
    """Gradient checkpointing recomputes the same activations: the same held-out KL at every check."""
    teacher = transformers.AutoModelForCausalLM.from_pretrained(peaked[0]).eval()
    curves = []
    for ckpt in (False, True):
        student = load_unfused(peaked[1], "cpu", torch.float32)
        res = tune_scales(student, teacher, samples(), TuneOptions(steps=8, lr=1e-2), torch.device("cpu"),
                          checkpointing=ckpt)
        assert res.checkpointing == ckpt and not student.training
        flag = "is_activation_checkpointing" if hasattr(student, "is_activation_checkpointing") else "is_gradient_checkpointing"
        assert not getattr(student, flag)
        curves.append([kl for _, kl in res.curve])
    assert curves[0] == pytest.approx(curves[1], rel=1e-5)
    assert curves[0][-1] < curves[0][0]
    calls = []
    for ckpt in (False, True):  # one step: two held-out checks, the step, and its recomputation
        student = load_unfused(peaked[1], "cpu", torch.float32)
        n = [0]
        real = F.linear

        def counted(x, w, *a):  # the down projection's dense product (module hooks miss the recompute)
            n[0] += w.shape == (64, 160)
            return real(x, w, *a)

        F.linear = counted
        try:
            tune_scales(student, teacher, samples(n=2), TuneOptions(steps=1), torch.device("cpu"), checkpointing=ckpt)
        finally:
            F.linear = real
        calls.append(n[0])
    assert calls == [12, 14]  # teacher and student, two layers each: the recomputation adds the two


def test_quantize_module_leaves_tuning_to_quantize_model():
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=256))
    from escha.model import quantize_module
    with pytest.raises(ModelError, match="does not tune"):
        quantize_module(model, QuantizeOptions(bits=2, tune_steps=8))


def test_biases_and_a_tied_head_tune_through_the_cli(tmp_path):
    """A Qwen2-style model (q/k/v biases) with its head tied to the embeddings."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                                   tie_word_embeddings=True, initializer_range=0.2)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / "m")
    out = tmp_path / "q"
    assert cli_main(["quantize", str(tmp_path / "m"), str(out), "--bits", "3", "--tune-steps", "6",
                     "--tune-lr", "1e-2", *FAST]) == 0
    tune = json.loads((out / "escha_report.json").read_text())["tune"]
    assert tune["steps"] == 6 and tune["kept_step"] > 0 and tune["kl_after"] < tune["kl_before"]
    from escha.model import load_model
    model = load_model(str(out), device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_failed_tuning_keeps_the_model(tiny, tmp_path, monkeypatch):
    """Asked for (--tune-steps N): a one-line error saying the model is there; by default (a plan
    with steps, on a GPU): a warning, and the report says what happened."""
    from escha.model import pipeline, quantize_model
    from escha.model.tune import TunePlan

    def broken(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(pipeline, "tune_directory", broken)
    out = tmp_path / "asked"
    with pytest.raises(ModelError, match=r"scale tuning failed \(RuntimeError: CUDA out of memory. Tried to "
                                         r"allocate 2.00 GiB\); .* holds the quantized model, untuned"):
        quantize_model(tiny, out, QuantizeOptions(bits=2, tune_steps=4, **FAST_OPTS))
    assert (out / "config.json").is_file()
    monkeypatch.setattr(pipeline, "_tune_plan", lambda *a, **k: TunePlan(256, torch.float32, False, 1))
    with pytest.warns(UserWarning, match="scale tuning failed"):
        report = quantize_model(tiny, tmp_path / "default", QuantizeOptions(bits=2, **FAST_OPTS))
    assert "untuned" in report.tune["error"]
    assert json.loads((tmp_path / "default" / "escha_report.json").read_text())["tune"] == report.tune
    assert any("scale tuning failed" in line for line in report.summary())
