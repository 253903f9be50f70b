"""transformers' from_pretrained loads an escha directory through the registered HfQuantizer."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import escha.integrations.hf as escha_hf  # noqa: E402
from escha.cli import main as cli_main  # noqa: E402
from escha.model import load_model  # noqa: E402
from escha.nn import EschaLinear, set_matmul_path  # noqa: E402

PROMPT = torch.tensor([[5, 9, 200, 31, 64]])


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("src"))
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                   max_position_embeddings=256)
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    out = str(tmp_path_factory.mktemp("q") / "out")
    assert cli_main(["quantize", src, out, "--bits", "3", "--encoder", "greedy", "--no-hessian",
                     "--seq-len", "48", "--quiet"]) == 0
    return out


def test_registered():
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
    assert AUTO_QUANTIZER_MAPPING["escha"] is escha_hf.EschaHfQuantizer
    assert AUTO_QUANTIZATION_CONFIG_MAPPING["escha"] is escha_hf.EschaConfig
    escha_hf.register()  # idempotent


def test_from_pretrained_matches_load_model(quantized):
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized).eval()
    ours = load_model(quantized, device="cpu")
    q = hf.model.layers[1].mlp.down_proj
    assert isinstance(q, EschaLinear) and q.bits == 3
    assert q.scale.dtype == torch.float16 and q.trellis.dtype == torch.int32
    assert isinstance(hf.lm_head, torch.nn.Linear)  # skipped by default
    a, b = hf.state_dict(), ours.state_dict()
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set_matmul_path(hf, "reference") == 14 and set_matmul_path(ours, "reference") == 14
    with torch.no_grad():
        ta = hf.generate(PROMPT, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        tb = ours.generate(PROMPT, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(ta, tb) and ta.shape[1] == PROMPT.shape[1] + 10
    assert hf.config.quantization_config.bits_map == json.load(
        open(os.path.join(quantized, "config.json")))["quantization_config"]["bits_map"]


def test_config_rejects_newer_format():
    with pytest.raises(ValueError, match="newer than this escha supports"):
        escha_hf.EschaConfig(bits_map={}, version=99)


def test_gemma3_loads_in_the_asked_dtype(tmp_path):
    """A bf16 Gemma 3 checkpoint loaded in fp32 by load_model computes what from_pretrained's
    model computes: buffers made at construction (the embedding scale sqrt(48), 6.93 in fp32 and
    6.94 in bf16) take the asked dtype, not the checkpoint's."""
    torch.manual_seed(2)
    cfg = transformers.Gemma3TextConfig(hidden_size=48, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=24, vocab_size=256,
                                        max_position_embeddings=256, sliding_window=16)
    transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(tmp_path / "src"))
    out = str(tmp_path / "out")
    assert cli_main(["quantize", str(tmp_path / "src"), out, "--bits", "2", "--encoder", "greedy", "--no-hessian",
                     "--seq-len", "48", "--quiet"]) == 0
    ours = load_model(out, device="cpu", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    scale = ours.model.embed_tokens.embed_scale
    assert scale.dtype == torch.float32 and float(scale) == pytest.approx(48 ** 0.5, rel=1e-6)
    a, b = dict(ours.named_buffers()), dict(hf.named_buffers())
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(ours(PROMPT).logits, hf(PROMPT).logits)


def test_static_cache_generate_compiles(quantized):
    """transformers compiles the decode step of ``generate(..., cache_implementation="static")``
    for an escha model loaded by from_pretrained (on accelerators by default; here on the CPU by
    its CompileConfig's switch), and the compiled steps give the eager steps' tokens."""
    import torch._dynamo
    from transformers import CompileConfig
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized).eval()
    assert hf.hf_quantizer.is_compileable
    config = CompileConfig()
    config._compile_all_devices = True  # transformers' own switch for compiling on the CPU
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        static = hf.generate(PROMPT, cache_implementation="static", compile_config=config, **kw)
        assert hasattr(hf, "_compiled_call")  # the decode steps ran compiled:
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # traced into a graph
        eager = hf.generate(PROMPT, **kw)
    assert torch.equal(static.sequences, eager.sequences)
    for a, b in zip(static.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_cache_generate_runs_cuda_graphs(quantized):
    """On a GPU, ``generate(..., cache_implementation="static")`` compiles the decode step with
    transformers' defaults (``mode="reduce-overhead"``: CUDA graphs over escha's kernels) and
    gives the eager steps' tokens, its logits within bf16's rounding of theirs."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.bfloat16).to("cuda").eval()
    ids = PROMPT.to("cuda")
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        eager = hf.generate(ids, **kw)
        static = [hf.generate(ids, cache_implementation="static", **kw) for _ in range(3)]  # warm-up, record, replay
    assert hasattr(hf, "_compiled_call")
    for run in static:
        assert torch.equal(run.sequences, eager.sequences)
        for a, b in zip(run.logits, eager.logits):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
