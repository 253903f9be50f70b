"""The RMSNorm before a layer's projections, applied in their input transform (escha.RowNorm,
escha.nn.fold_norms)."""
import pytest
import torch

import escha
from escha import RowNorm
from escha.format import dequantize, random_qweight
from escha.nn import EschaLinear, FoldedNorm, fold_norms, set_matmul_path
from escha.norm import HeadNorm
from escha.quant import quantize_shared

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

IN = 320  # three Hadamard blocks, the last one part padding


def _norm(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return RowNorm((torch.rand(IN, generator=g) + 0.5).to(dtype), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_row_norm_is_the_models_rmsnorm(dtype):
    norm = _norm(dtype)
    hf = LlamaRMSNorm(IN, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(norm.weight)
    x = (torch.randn(4, 7, IN) * 5).to(dtype)
    assert torch.equal(norm.apply(x), hf(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits", [2, 3])
def test_decode_applies_the_norm_in_its_input_transform(dtype, bits):
    """The decode kernel (Triton's interpreter here) with the norm in its input transform, against
    the product of the normalised rows: the norm only moves where x' is rounded to fp16."""
    qw = random_qweight(256, IN, bits, seed=bits)
    norm = _norm(dtype, seed=bits)
    x = (torch.randn(5, IN) * 4).to(dtype)
    fused = escha.matmul(x, qw, path="decode", norm=norm)
    normed = norm.apply(x)
    ref = normed.double() @ dequantize(qw).double().T
    assert fused.dtype == dtype and fused.shape == (5, 256)
    rel = float((fused.double() - ref).norm() / ref.norm())
    assert rel < 2.0**-10 + (2.0**-11 if dtype == torch.float16 else 0), rel  # decode's tolerance (KERNELS.md)
    # The reference path normalises first, exactly as the model does: bit for bit the product of norm.apply(x).
    assert torch.equal(escha.matmul(x, qw, path="reference", norm=norm), escha.matmul(normed, qw, path="reference"))


@pytest.mark.parametrize("path,tol", [("dequant-core-fp8", 0.077), ("dequant-fp8", 0.077), ("prefill", 0.077),
                                      ("dequant-core-bf16", 0.0059), ("dequant-bf16", 0.0059)])
def test_prefill_paths_apply_the_norm_in_their_activation_pass(path, tol):
    """The dequantize-once and fused prefill paths (Triton's interpreter here) with the norm in
    their activation pass: the same op on the rows ``norm.apply`` normalised first, within the
    path's tolerance of that and of fp64 (KERNELS.md: e4m3 operands 0.077, bf16 0.0059); and far
    from the product of the plain rows, so the norm was applied."""
    qw = random_qweight(256, IN, 2, seed=7)
    norm = _norm(torch.bfloat16, seed=7)
    x = (torch.randn(6, IN) * 4).to(torch.bfloat16)
    fused = escha.matmul(x, qw, path=path, norm=norm)
    normed = norm.apply(x)
    first = escha.matmul(normed, qw, path=path)
    ref = normed.double() @ dequantize(qw).double().T
    assert fused.dtype == torch.bfloat16 and fused.shape == (6, 256)
    for want in (first.double(), ref):
        rel = float((fused.double() - want).norm() / want.norm())
        assert rel < tol, (path, rel)
    plain = x.double() @ dequantize(qw).double().T
    assert float((fused.double() - plain).norm() / plain.norm()) > 0.1
    # Their output has no transform to take a head norm: it is applied after, to the fused product.
    head = HeadNorm((torch.rand(256) + 0.5).to(torch.bfloat16), torch.tensor([1, 0], dtype=torch.int8), 1e-6)
    assert torch.equal(escha.matmul(x, qw, path=path, norm=norm, head_norm=head), head.apply(fused))


def test_norm_the_kernel_cannot_take_is_applied_first():
    """A norm whose weight has another dtype than x (fp32 weight, fp16 x) runs in PyTorch before
    the kernel; the result has the normalised rows' dtype, as in the model."""
    qw = random_qweight(128, IN, 2, seed=4)
    norm = _norm(torch.float32)
    x = torch.randn(3, IN).half()
    y = escha.matmul(x, qw, path="decode", norm=norm)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, escha.matmul(norm.apply(x), qw, path="decode"))


def test_bad_norms_are_refused():
    qw = random_qweight(128, IN, 2)
    x = torch.randn(2, IN)
    with pytest.raises(TypeError, match="escha.RowNorm"):
        escha.matmul(x, qw, norm=(torch.ones(IN), 1e-6))
    with pytest.raises(ValueError, match=r"\[320\]"):
        escha.matmul(x, qw, norm=RowNorm(torch.ones(IN + 1), 1e-6))
    with pytest.raises(ValueError, match="non-negative"):
        RowNorm(torch.ones(IN), -1.0)
    with pytest.raises(TypeError, match="1-D"):
        RowNorm(torch.ones(2, IN), 1e-6)
    with pytest.raises(TypeError, match="RowNorm.eps must be a float, got NoneType"):
        RowNorm(torch.ones(IN), None)
    with pytest.raises(TypeError, match="RowNorm.eps must be a float, got str"):
        RowNorm(torch.ones(IN), "1e-6")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_applies_head_norms_in_its_output_transform(dtype):
    """Per-head RMSNorms of flagged 128-row blocks (Qwen3's q_norm, k_norm): the decode kernel's
    output transform against the same norm applied to its output, and the reference path exactly."""
    qw = random_qweight(384, IN, 2, seed=5)  # blocks: a head, a head, not normalised
    g = torch.Generator().manual_seed(6)
    weight = torch.cat([torch.rand(256, generator=g) + 0.5, torch.zeros(128)]).to(dtype)
    head = HeadNorm(weight, torch.tensor([1, 1, 0], dtype=torch.int8), 1e-6)
    x = (torch.randn(5, IN, generator=g) * 3).to(dtype)
    plain = escha.matmul(x, qw, path="decode")
    y = escha.matmul(x, qw, path="decode", head_norm=head)
    assert y.dtype == dtype and torch.equal(y[:, 256:], plain[:, 256:])  # the plain block untouched
    want = head.apply(plain)
    assert float((y.double() - want.double()).norm() / want.double().norm()) < 2.0**-10
    h = plain[:, :128].float()  # by hand: one head, as transformers' Qwen3RMSNorm computes it
    by_hand = weight[:128] * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(want[:, :128], by_hand)
    ref = escha.matmul(x, qw, path="reference")
    assert torch.equal(escha.matmul(x, qw, path="reference", head_norm=head), head.apply(ref))


def test_bad_head_norms_are_refused():
    qw = random_qweight(256, IN, 2)
    with pytest.raises(TypeError, match="HeadNorm"):
        escha.matmul(torch.randn(2, IN), qw, head_norm=torch.ones(256))
    with pytest.raises(ValueError, match=r"\[256\] row weights and \[2\] block flags"):
        escha.matmul(torch.randn(2, IN), qw, head_norm=HeadNorm(torch.ones(128), torch.ones(1, dtype=torch.int8), 0.0))
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        HeadNorm(torch.ones(200), torch.ones(2, dtype=torch.int8), 1e-6)
    with pytest.raises(ValueError, match=r"one flag a block, \[2\]"):
        HeadNorm(torch.ones(256), torch.ones(3, dtype=torch.int8), 1e-6)
    with pytest.raises(ValueError, match="non-negative"):
        HeadNorm(torch.ones(256), torch.ones(2, dtype=torch.int8), -1.0)
    with pytest.raises(TypeError, match="HeadNorm.eps must be a float, got NoneType"):
        HeadNorm(torch.ones(256), torch.ones(2, dtype=torch.int8), None)
    with pytest.raises(TypeError, match="HeadNorm.eps must be a float, got str"):
        HeadNorm(torch.ones(256), torch.ones(2, dtype=torch.int8), "1e-6")


@pytest.mark.parametrize("path", ["reference", "decode", "dequant-core-fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_through_the_norms(path, dtype):
    """With a RowNorm before and a HeadNorm after, x and both norms' weights get the gradient of
    head(norm(x) @ W_hat^T) as the model computes it, whichever path (fused or not) ran the forward."""
    qw = random_qweight(200, IN, 2, seed=9)  # two blocks of output rows, the second ragged
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, 3, IN, generator=g) * 3).to(dtype).requires_grad_(True)
    norm_weight = (torch.rand(IN, generator=g) + 0.5).to(dtype).requires_grad_(True)
    head_weight = (torch.rand(256, generator=g) + 0.5).to(dtype).requires_grad_(True)
    blocks = torch.tensor([1, 0], dtype=torch.int8)
    y = escha.matmul(x, qw, path=path, norm=RowNorm(norm_weight, 1e-6), head_norm=HeadNorm(head_weight, blocks, 1e-6))
    up = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(up)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, norm_weight, head_weight)]
    z = RowNorm(leaves[1], 1e-6).apply(leaves[0]) @ dequantize(qw).double().T
    HeadNorm(leaves[2], blocks, 1e-6).apply(z).backward(up.double())
    # fp32: the one difference is fp32 against fp64 math; bf16: the forward's roundings of the
    # normalised rows and of the product to bf16, which the gradient passes through, a few ulps.
    tol = 1e-5 if dtype == torch.float32 else 4 * 2.0**-8
    for got, want in zip((x.grad, norm_weight.grad, head_weight.grad), leaves):
        assert got.dtype == dtype
        err = float((got.double() - want.grad).norm() / want.grad.norm())
        assert err < tol, err
    assert torch.equal(head_weight.grad[128:], torch.zeros(128, dtype=dtype))  # the plain block's weights: unused


def test_gradient_through_the_row_norm_alone():
    """Only a RowNorm, and x without grad: its weight alone gets one."""
    qw = random_qweight(128, IN, 2, seed=10)
    norm_weight = (torch.rand(IN) + 0.5).requires_grad_(True)
    x = torch.randn(4, IN)
    up = torch.randn(4, 128)
    escha.matmul(x, qw, norm=RowNorm(norm_weight, 1e-6)).backward(up)
    w = norm_weight.detach().double().requires_grad_(True)
    (RowNorm(w, 1e-6).apply(x.double()) @ dequantize(qw).double().T).backward(up.double())
    assert float((norm_weight.grad.double() - w.grad).norm() / w.grad.norm()) < 1e-5


def test_head_norm_the_kernel_cannot_take_is_applied_after():
    """Weights the output transform cannot read as they are (strided here) go the PyTorch way
    after the product: the same result as the norm applied to the plain product."""
    qw = random_qweight(256, IN, 2, seed=8)
    weight = (torch.rand(256, 2) + 0.5).half()[:, 0]  # a column: stride 2
    head = HeadNorm(weight, torch.tensor([1, 0], dtype=torch.int8), 1e-6)
    x = torch.randn(4, IN).half()
    assert not head.fusable(x)
    assert torch.equal(escha.matmul(x, qw, path="decode", head_norm=head),
                       head.apply(escha.matmul(x, qw, path="decode")))


def _unfold(model):
    """RMSNorms back in place of the folded ones (Llama's, Qwen2's and Qwen3's compute the same),
    and the projections plain again."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FoldedNorm):
                norm = LlamaRMSNorm(child.weight.shape[0], eps=child.variance_epsilon)
                norm.weight = child.weight
                setattr(module, name, norm)
        if isinstance(module, EschaLinear):
            object.__setattr__(module, "_input_norm", None)
            object.__setattr__(module, "_output_norm", None)
    return model


def _assert_same_as_unfolded(folded, plain):
    """Logits bit for bit on the reference path (which normalises exactly as the model does), and
    the same greedy tokens through the kernels (the interpreter here), which fold the norms."""
    ids = torch.tensor([[3, 17, 99, 42, 7, 128]], device=folded.device)  # load_model puts it on a GPU if any
    with torch.no_grad():
        set_matmul_path(folded, "reference")
        set_matmul_path(plain, "reference")
        assert torch.equal(folded(ids).logits, plain(ids).logits)
        set_matmul_path(folded, None)
        set_matmul_path(plain, None)
        assert torch.equal(folded.generate(ids, max_new_tokens=4, do_sample=False),
                           plain.generate(ids, max_new_tokens=4, do_sample=False))


def test_qwen3_folds_its_head_norms(tmp_path):
    """A Qwen3 with 128-wide heads: q_norm and k_norm go into the q/k/v product's output transform,
    the layer norms into its input transform; logits bit for bit the unfolded model's on the
    reference path, and the same greedy tokens through the kernels."""
    from escha.model import QuantizeOptions, load_model, quantize_model
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128, vocab_size=256, max_position_embeddings=128)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3RMSNorm":
                m.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "src")
    quantize_model(str(tmp_path / "src"), str(tmp_path / "q"),
                   QuantizeOptions(bits=2, encoder="greedy", use_hessian=False, seq_len=32, progress=False))
    folded = load_model(str(tmp_path / "q"))
    attn = folded.model.layers[0].self_attn
    assert isinstance(attn.q_norm, FoldedNorm) and isinstance(attn.k_norm, FoldedNorm)
    assert attn.q_proj.head_norm is not None and attn.v_proj.head_norm is None
    assert "model.layers.0.self_attn.q_norm.weight" in folded.state_dict()
    _assert_same_as_unfolded(folded, _unfold(load_model(str(tmp_path / "q"))))


def _llama(tmp_path, skip=("lm_head",)):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms initialise to ones, which would hide a weight left out
        for m in model.modules():
            if isinstance(m, LlamaRMSNorm):
                m.weight.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "src")
    from escha.model import QuantizeOptions, quantize_model
    quantize_model(str(tmp_path / "src"), str(tmp_path / "q"),
                   QuantizeOptions(bits=2, encoder="greedy", use_hessian=False, seq_len=32, progress=False, skip=skip))
    return str(tmp_path / "q")


def test_loaded_model_folds_its_norms(tmp_path):
    from escha.model import load_model
    path = _llama(tmp_path)
    model = load_model(path)
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, FoldedNorm) and isinstance(layer.post_attention_layernorm, FoldedNorm)
    assert layer.self_attn.q_proj.input_norm is not None and layer.self_attn.o_proj.input_norm is None
    assert isinstance(model.model.norm, LlamaRMSNorm)  # the final norm feeds the (dense) head: kept
    state = model.state_dict()
    assert "model.layers.0.input_layernorm.weight" in state and not any("input_norm" in k for k in state)
    _assert_same_as_unfolded(model, _unfold(load_model(path)))


def test_norm_with_a_dense_reader_is_kept(tmp_path):
    """v_proj left dense: it must get the normalised input, so input_layernorm stays; the MLP's folds."""
    from escha.model import load_model
    model = load_model(_llama(tmp_path, skip=("lm_head", "v_proj")))
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, LlamaRMSNorm)
    assert isinstance(layer.post_attention_layernorm, FoldedNorm)
    assert fold_norms(model) == 0  # nothing left to fold


def test_unknown_layer_classes_are_left_alone():
    """A layer shaped like Llama's but of a class whose forward is not known: not folded (its norm
    may feed something else)."""

    class MyDecoderLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = LlamaRMSNorm(64)
            self.self_attn = torch.nn.Module()
            for name, qw in zip(("q_proj", "k_proj", "v_proj"),
                                quantize_shared([torch.randn(64, 64) for _ in range(3)], encoder="greedy")):
                setattr(self.self_attn, name, EschaLinear.from_quantized(qw))

    layer = MyDecoderLayer()
    assert fold_norms(layer) == 0 and isinstance(layer.input_layernorm, LlamaRMSNorm)
    assert layer.self_attn.q_proj.input_norm is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["decode", "decode-wgmma", "decode-fp8", "dequant-core-fp8", "dequant-fp8",
                                  "dequant-core-bf16", "dequant-bf16", "prefill"])
@pytest.mark.parametrize("m", [1, 8, 64, 100, 200])
def test_norm_in_the_input_transform_on_the_gpu(path, m):
    """bf16 rows of a Qwen3-14B width through the RMSNorm in the input transform, against fp64 of the
    normalised rows (norm.apply, as the model computes it), within the path's tolerance (fp16
    operands: the decode table; e4m3 operands: the fp8 paths' bound)."""
    if path.startswith("decode-") and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{path} runs on Hopper")
    if path == "decode" and m > 64:
        pytest.skip("the portable decode kernel takes at most 64 tokens")
    qw = random_qweight(1024, 5120, 2, seed=m, device="cuda")
    norm = RowNorm((torch.rand(5120, device="cuda") + 0.5).to(torch.bfloat16), 1e-6)
    x = (torch.randn(m, 5120, device="cuda") * 3).to(torch.bfloat16)
    y = escha.matmul(x, qw, path=path, norm=norm)
    ref = norm.apply(x).double() @ dequantize(qw).double().T
    assert y.dtype == torch.bfloat16
    rel = float((y.double() - ref).norm() / ref.norm())
    # bf16 output, fp16 operands (KERNELS.md tolerance table); e4m3 operands: the fp8 table's 0.077;
    # the bf16 prefill paths: 0.0059 (KERNELS.md, Prefill, Accuracy)
    tol = {"decode-fp8": 0.077, "dequant-core-fp8": 0.077, "dequant-fp8": 0.077, "prefill": 0.077,
           "dequant-core-bf16": 0.0059, "dequant-bf16": 0.0059}.get(path, 2.0**-8 + 2.0**-10)
    assert rel < tol, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_and_folded_model_on_the_gpu():
    """A bf16 Qwen3 of two layers with random Escha weights (benchmarks/bench_e2e.py's build): q/k/v
    and gate/up as one product each with their RMSNorms folded in, against the same weights run one
    Linear at a time with the model's norms; one decode step replayed from a CUDA graph equals eager."""
    from benchscripts import load
    e2e = load("bench_e2e")
    shape = dict(e2e.TINY, hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=128)
    config = e2e.make_config(shape)
    cuda = torch.device("cuda")
    grouped, alone = (e2e.build(config, arm, cuda, 2) for arm in ("escha", "escha-unshared"))
    layer = grouped.model.layers[0]
    assert isinstance(layer.input_layernorm, FoldedNorm) and layer.self_attn.k_proj._shared is not None
    ids = torch.randint(0, shape["vocab_size"], (1, 9), device=cuda)
    with torch.no_grad():
        a, b = grouped(ids).logits.float(), alone(ids).logits.float()
        assert float((a - b).norm() / b.norm()) < 2e-2  # bf16 activations through two layers
        step = ids[:, :1]
        eager = grouped(step).logits
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            graphed = grouped(step).logits
        graphed.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(graphed, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["decode", "decode-wgmma", "decode-fp8"])
@pytest.mark.parametrize("m", [1, 8, 64, 100, 200])
def test_head_norms_in_the_output_transform_on_the_gpu(path, m):
    """Qwen3-14B's stacked q/k/v rows (40 + 8 normalised heads, 8 plain) in bf16 with the heads'
    RMSNorm in the output transform, against the same norm applied to the plain product."""
    if path != "decode" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{path} runs on Hopper")
    if path == "decode" and m > 64:
        pytest.skip("the portable decode kernel takes at most 64 tokens")
    qw = random_qweight(7168, 5120, 2, seed=m, device="cuda")
    weight = torch.cat([(torch.rand(6144, device="cuda") + 0.5), torch.zeros(1024, device="cuda")]).to(torch.bfloat16)
    flags = torch.cat([torch.ones(48), torch.zeros(8)]).to(torch.int8).cuda()
    head = HeadNorm(weight, flags, 1e-6)
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    y = escha.matmul(x, qw, path=path, head_norm=head)
    plain = escha.matmul(x, qw, path=path)
    assert torch.equal(y[:, 6144:], plain[:, 6144:])
    want = head.apply(plain)
    rel = float((y.double() - want.double()).norm() / want.double().norm())
    assert rel < 2.0**-7, rel  # at most an ulp of bf16 where an fp32 sum order moves rsqrt


def test_head_norm_follows_its_weight():
    """The HeadNorm a layer builds from its folded norm is rebuilt when the weight is cast, moved or
    written in place (the Parameter object stays the same through .to())."""
    lin = EschaLinear.from_quantized(random_qweight(256, 128, 2))
    folded = FoldedNorm(LlamaRMSNorm(128))
    object.__setattr__(lin, "_output_norm", folded)
    first = lin.head_norm
    assert first is lin.head_norm and first.weight.shape == (256,) and first.blocks.tolist() == [1, 1]
    folded.to(torch.float64)
    assert lin.head_norm.weight.dtype == torch.float64
    with torch.no_grad():
        folded.weight.mul_(2)
    assert torch.equal(lin.head_norm.weight[:128], folded.weight)
