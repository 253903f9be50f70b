"""Scalar peers (RTN, MXFP4, GPTQ-style LDLQ) and their model driver; the calibration corpus."""
import os

import pytest
import torch

from escha.model import calib
from escha.model.calib import BUILTIN_TEXT, calibration_seq_len, read_calibration, spread, tokenize
from escha.quant.scalar import MXFP4_BPW, group_grid, ldlq_scalar, mxfp4, rtn, rtn_bpw


def correlated(n_in: int, n_tok: int = 4096, seed: int = 0) -> torch.Tensor:
    """Inputs with a strongly non-diagonal covariance, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n_in, n_in, generator=g) / n_in**0.5 + torch.eye(n_in)
    return torch.randn(n_tok, n_in, generator=g) @ mix


def on_grid(w_hat, w, bits, group=64):
    scale, zero = group_grid(w, bits, group)
    g = w_hat.reshape(w.shape[0], -1, group)
    q = (g - zero[..., None]) / scale[..., None]
    return bool(((q - q.round()).abs() < 1e-3).all() and (q.round() >= 0).all() and (q.round() <= 2**bits - 1).all())


def test_rtn_grid_error_and_rate():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(1))
    errs = []
    for bits in (2, 3, 4):
        w_hat = rtn(w, bits)
        assert on_grid(w_hat, w, bits)
        scale, _ = group_grid(w, bits)
        # Round to nearest: every error within half a step (plus fp16 rounding of scale and zero).
        step = scale.repeat_interleave(64, dim=1)
        assert ((w - w_hat).abs() <= step / 2 + 2e-3).all()
        errs.append(float((w - w_hat).pow(2).mean()))
    assert errs[0] > errs[1] > errs[2]
    assert rtn_bpw(2) == 2.5 and rtn_bpw(4, 32) == 5.0 and MXFP4_BPW == 4.25


def test_mxfp4_values_are_e2m1_times_a_power_of_two():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(2))
    w_hat = mxfp4(w)
    g, gh = w.reshape(8, 2, 32), w_hat.reshape(8, 2, 32)
    scale = torch.pow(2.0, torch.floor(torch.log2(g.abs().amax(-1, keepdim=True))) - 2)
    mags = (gh / scale).abs()
    assert torch.isin(mags, torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])).all()
    assert float((w - w_hat).pow(2).mean()) < float((w - rtn(w, 2)).pow(2).mean())


def test_ldlq_scalar_stays_on_the_grid_and_beats_rtn_on_the_proxy():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(3))
    x = correlated(128)
    h = x.T @ x / x.shape[0]
    for bits in (2, 3):
        w_g, w_r = ldlq_scalar(w, h, bits), rtn(w, bits)
        assert on_grid(w_g, w, bits)
        proxy = lambda wh: float((((w - wh) @ h) * (w - wh)).sum())  # noqa: E731
        assert proxy(w_g) < 0.8 * proxy(w_r)
    # With uncorrelated inputs there is nothing to feed forward: LDLQ is round-to-nearest.
    assert torch.equal(ldlq_scalar(w, torch.eye(128), 3), rtn(w, 3))


def test_fake_quantize_module_on_a_tiny_llama():
    transformers = pytest.importorskip("transformers")
    from escha.model import QuantizeOptions
    from escha.model.fakequant import fake_quantize_module
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg).eval()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    seen = {}

    def gptq3(name, w, h):
        seen[name] = h
        return ldlq_scalar(w, h, 3)

    opts = QuantizeOptions(seq_len=32, max_samples=4, progress=False)
    rep = fake_quantize_module(model, gptq3, opts)
    assert len(seen) == 14 and "lm_head" not in seen and all(h.shape[0] in (64, 128) for h in seen.values())
    assert rep.params == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)  # q, o; k, v; gate, up, down
    for n, w in before.items():
        after = model.get_submodule(n).weight
        if n == "lm_head":
            assert torch.equal(after, w)
        else:
            assert not torch.equal(after, w) and on_grid(after.detach(), w, 3)
            assert 0 < rep.proxy_rel[n] < 1
    model2 = transformers.LlamaForCausalLM(cfg).eval()
    rep2 = fake_quantize_module(model2, lambda n, w, h: rtn(w, 4), opts, use_hessian=False)
    assert not rep2.calibration and len(rep2.proxy_rel) == 14


# -- the calibration corpus ---------------------------------------------------------------------
def test_corpus_ships_and_mixes_its_sources():
    assert os.path.isfile(calib.CORPUS_PATH) and os.path.getsize(calib.CORPUS_PATH) < 1_600_000
    paras = read_calibration(None)
    text = "\n\n".join(paras)
    assert len(text) > 3_000_000 and len(text.split()) > 450_000
    # One marker of each source, and all three in the first tenth (they are interleaved).
    head = "\n\n".join(paras[:len(paras) // 10])
    for marker in ("Python", "hacker", ", n. "):
        assert marker in head


def test_tokenize_spreads_samples_over_the_stream():
    paras = read_calibration(None)
    s = tokenize(paras, None, 256, True, 2048, 128)
    assert len(s.samples) == 128 and s.tokens == 128 * 2048
    stream = "\n\n".join(paras).encode("utf-8")
    n_chunks = -(-len(stream) // 2048)
    for i in (0, 1, 77, 127):
        j = spread(n_chunks, 128)[i]
        assert s.samples[i][0].tolist() == [b % 256 for b in stream[j * 2048:(j + 1) * 2048]]
    assert spread(10, 4) == [0, 2, 5, 7] and spread(3, 5) == [0, 1, 2]
    enc = tokenize(paras, None, 256, False, 512, 16)
    assert len(enc.samples) == 16 and all(x.shape[1] <= 512 for x in enc.samples)


def test_builtin_sentences_when_the_corpus_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(calib, "CORPUS_PATH", str(tmp_path / "missing.txt.xz"))
    assert read_calibration(None) == list(BUILTIN_TEXT)
    assert "missing" in calib.default_calibration()[1]


def test_calibration_seq_len_respects_the_model():
    class Cfg:
        max_position_embeddings = 512
    assert calibration_seq_len(Cfg(), 2048) == 512 and calibration_seq_len(Cfg(), 100) == 100
    assert calibration_seq_len(object(), 2048) == 2048
