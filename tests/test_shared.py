"""Projections over one input: quantized together, stacked into one weight, run as one product."""
import pytest
import safetensors.torch
import torch
from torch import nn

import escha
from escha.format import QuantizedWeight, ShardError, dequantize, random_qweight
from escha.format.shard import concat_rows, row_offsets, split_rows
from escha.nn import EschaLinear, SharedInput, set_matmul_path, share_inputs
from escha.quant import quantize_shared

transformers = pytest.importorskip("transformers")

IN = 192  # two Hadamard blocks, the second half padding
SHAPES = [(200, IN), (128, IN), (72, IN)]  # a padded q, a whole-block k, a short v


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o, i, generator=g) * s for (o, i), s in zip(SHAPES, (1.0, 3.0, 0.5))]


@pytest.fixture(scope="module")
def members():
    return quantize_shared(_weights(), bits=2, seed=3, encoder="greedy")


# -- the format: stacking by rows -------------------------------------------------------------------
def test_concat_rows_keeps_every_row_bit_for_bit(members):
    stacked = concat_rows(members)
    assert row_offsets([200, 128, 72]) == [0, 256, 384]
    assert stacked.shape == (456, IN) and stacked.padded_shape == (512, 256)
    whole = dequantize(stacked)
    for qw, off in zip(members, row_offsets([q.out_features for q in members])):
        assert torch.equal(dequantize(qw), whole[off:off + qw.out_features])
    back = split_rows(stacked, [200, 128, 72])
    assert [b.shape for b in back] == [q.shape for q in members]
    assert all(torch.equal(a.trellis, b.trellis) and torch.equal(a.scale, b.scale) for a, b in zip(back, members))
    assert back[1].trellis.data_ptr() == stacked.trellis[16:24].data_ptr()  # views, not copies


def test_concat_rows_refuses_weights_over_other_inputs(members):
    with pytest.raises(ShardError, match="other input signs or another global scale"):
        concat_rows([members[0], random_qweight(64, IN, 2, seed=1)])
    with pytest.raises(ShardError, match="does not read the input"):
        concat_rows([members[0], random_qweight(64, 128, 2, seed=1)])
    with pytest.raises(ShardError, match="at least one"):
        concat_rows([])
    with pytest.raises(ShardError, match="do not make the 456 rows"):
        split_rows(concat_rows(members), [200, 128, 70])


# -- the quantizer -----------------------------------------------------------------------------------
def test_quantize_shared_gives_valid_weights_of_one_input(members):
    ws = _weights()
    assert [q.shape for q in members] == SHAPES
    assert all(torch.equal(q.sv, members[0].sv) and torch.equal(q.gscale, members[0].gscale) for q in members)
    assert len({q.trellis.data_ptr() for q in members}) == 3  # each owns its tensors (stored alone)
    for w, q in zip(ws, members):
        QuantizedWeight(*q.tensors().values(), shape=q.shape, bits=2)  # validates every value
        err = float((dequantize(q) - w).pow(2).mean() / w.pow(2).mean())
        alone = escha.quantize(w, bits=2, seed=3, encoder="greedy")
        err_alone = float((dequantize(alone) - w).pow(2).mean() / w.pow(2).mean())
        assert err < 1.1 * err_alone, (err, err_alone)  # each row keeps its own scale


def test_quantize_shared_refuses_bad_input():
    with pytest.raises(ValueError, match="equal in_features"):
        quantize_shared([torch.randn(8, 16), torch.randn(8, 32)], encoder="greedy")
    with pytest.raises(TypeError, match="non-empty sequence"):
        quantize_shared([])
    with pytest.raises(ValueError, match=r"Ws\[1\]"):
        quantize_shared([torch.randn(8, 16), torch.full((8, 16), float("nan"))])


# -- the module: one product for the group ------------------------------------------------------------
class Block(nn.Module):
    """q, k, v over one input and o over another of the same width, as in an attention block."""

    def __init__(self, members):
        super().__init__()
        self.q, self.k, self.v = (EschaLinear.from_quantized(q) for q in members)
        self.o = EschaLinear.from_quantized(quantize_shared([torch.randn(IN, IN)], encoder="greedy")[0])


def close(y: torch.Tensor, want: torch.Tensor) -> None:
    """Normwise within fp32 reach: the reference path works in the transform domain in fp32, so
    it differs from x @ W_hat^T by a few fp32 roundings of the K-long sums (~1e-7 relative)."""
    assert y.shape == want.shape
    rel = float((y.double() - want.double()).norm() / want.double().norm())
    assert rel < 1e-5, rel


def _matmul_calls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "escha::matmul")


def test_group_runs_one_product_for_its_members(members):
    block = Block(members)
    assert share_inputs(block) == 1 and block.o._shared is None
    group = block.q._shared
    assert isinstance(group, SharedInput) and group.members == [block.q, block.k, block.v]
    set_matmul_path(block, "reference")
    x = torch.randn(3, 5, IN)
    want = [x @ dequantize(m.qweight).T for m in (block.q, block.k, block.v)]
    got = []
    assert _matmul_calls(lambda: got.extend([block.q(x), block.k(x), block.v(x)])) == 1
    for y, w in zip(got, want):
        close(y, w)
    # Once every member took its rows, the next call is a new product.
    assert _matmul_calls(lambda: [block.q(x), block.k(x), block.v(x)]) == 1 and not group.diverged
    # The input written in place between two members: the others read another input, so they
    # run alone and the group stops sharing.
    x2 = x.clone()
    block.q(x2)
    x2.mul_(2)
    assert _matmul_calls(lambda: got.extend([block.k(x2), block.v(x2)])) == 2 and group.diverged
    close(got[-1], x2 @ dequantize(block.v.qweight).T)


def test_group_stops_sharing_when_inputs_differ(members):
    block = Block(members)
    share_inputs(block)
    set_matmul_path(block, "reference")
    x, other = torch.randn(4, IN), torch.randn(4, IN)
    block.q(x)
    y = block.k(other)  # k does not read q's input: it runs alone, and the group stops for good
    close(y, other @ dequantize(block.k.qweight).T)
    assert block.q._shared.diverged
    assert _matmul_calls(lambda: [block.q(x), block.k(x), block.v(x)]) == 3


def test_group_state_dict_moves_and_replaced_weights(members, tmp_path):
    block = Block(members)
    share_inputs(block)
    # The members hold views of one stacked weight; the state dict holds tensors of their own.
    assert block.k.trellis.untyped_storage().data_ptr() == block.q.trellis.untyped_storage().data_ptr()
    state = block.state_dict()
    safetensors.torch.save_file(state, tmp_path / "block.safetensors")  # refuses tensors sharing memory
    fresh = Block(members)
    fresh.load_state_dict(safetensors.torch.load_file(tmp_path / "block.safetensors"))
    share_inputs(fresh)
    set_matmul_path(block, "reference")
    set_matmul_path(fresh, "reference")
    x = torch.randn(2, IN)
    torch.testing.assert_close([fresh.q(x), fresh.k(x), fresh.v(x)], [block.q(x), block.k(x), block.v(x)])
    # A weight replaced by one quantized alone: the group stops, each member still right.
    other = escha.quantize(torch.randn(128, IN), bits=2, encoder="greedy", seed=9)
    block.k.set_qweight(other)
    ys = [block.q(x), block.k(x), block.v(x)]
    assert block.q._shared.diverged
    close(ys[1], x @ dequantize(other).T)


def test_share_inputs_needs_weights_quantized_together():
    block = nn.Module()
    block.a = EschaLinear.from_quantized(random_qweight(128, IN, 2, seed=1))
    block.b = EschaLinear.from_quantized(random_qweight(128, IN, 2, seed=2))
    assert share_inputs(block) == 0 and block.a._shared is None
    with pytest.raises(ValueError, match="at least two"):
        SharedInput([block.a])


# -- whole models ---------------------------------------------------------------------------------------
def test_quantized_model_groups_qkv_and_gate_up(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "src")
    from escha.model import QuantizeOptions, load_model, quantize_model
    report = quantize_model(str(tmp_path / "src"), str(tmp_path / "q"),
                            QuantizeOptions(bits=2, encoder="greedy", use_hessian=False, seq_len=32, progress=False))
    shared = {s.name.split(".")[-1]: s.shared_input.split(".")[-1] for s in report.stats if ".0." in s.name}
    assert shared == {"q_proj": "q_proj", "k_proj": "q_proj", "v_proj": "q_proj", "o_proj": "o_proj",
                      "gate_proj": "gate_proj", "up_proj": "gate_proj", "down_proj": "down_proj"}
    model = load_model(str(tmp_path / "q"))
    groups = {id(m._shared): m._shared for m in model.modules() if isinstance(m, EschaLinear) and m._shared}
    assert len(groups) == 4  # per layer: [q | k | v] and [gate | up]
    set_matmul_path(model, "reference")
    ids = torch.tensor([[3, 17, 99, 42, 7]])
    with torch.no_grad():
        assert _matmul_calls(lambda: model(ids)) == 2 * 4  # 7 Linears a layer in 4 products
        grouped = model(ids).logits
        for g in groups.values():
            g.diverged = True  # each member alone again
        alone = model(ids).logits
    torch.testing.assert_close(grouped, alone, rtol=1e-4, atol=1e-4)


# -- torch.compile ----------------------------------------------------------------------------------------
def _compiled_ops(fn, *args, fullgraph=True):
    """fn compiled (no code generation: the graphs run as traced) and called: its result, and
    the escha::matmul calls in each graph Dynamo made."""
    import torch._dynamo
    torch._dynamo.reset()
    counts = []

    def backend(gm, example_inputs):
        counts.append(sum(1 for n in gm.graph.nodes if "escha" in str(n.target)))
        return gm.forward

    return torch.compile(fn, backend=backend, fullgraph=fullgraph)(*args), counts


def test_group_runs_one_product_under_torch_compile(members):
    """Traced code keeps the grouping: one product in one graph, equal to the eager members'.
    A member whose buffers were replaced runs alone in traced code, which cannot restack, and the
    others still take their rows of the stack; the next eager call restacks."""
    block = Block(members)
    share_inputs(block)
    set_matmul_path(block, "reference")
    x = torch.randn(3, IN)

    def qkv(x):
        return block.q(x), block.k(x), block.v(x)

    want = qkv(x)
    got, counts = _compiled_ops(qkv, x)
    assert counts == [1] and all(torch.equal(a, b) for a, b in zip(got, want))
    assert not block.q._shared.diverged and block.q._shared._pending == set()
    block.k._buffers["trellis"] = block.k._buffers["trellis"].clone()  # what a move does to a buffer
    assert block.k.qweight.trellis is block.k._buffers["trellis"]  # k's own weight, rebuilt eagerly
    # (q and v keep the weights the stacking gave them: views of the stack)
    got, counts = _compiled_ops(qkv, x)
    assert counts == [2]  # the stack for q and v, k alone
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    close(got[1], want[1])  # alone: other fp32 sums than the stacked product's
    assert _matmul_calls(lambda: qkv(x)) == 1  # eager: restacked, one product again
    block.v.trellis = block.v.trellis.clone()  # an assignment, seen by its count alone
    got, counts = _compiled_ops(qkv, x)
    assert counts == [2] and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    close(got[2], want[2])
    assert _matmul_calls(lambda: qkv(x)) == 1
    block.q.trellis = block.q.trellis.clone()  # the first caller replaced: k and v share, q alone
    step = torch.compile(qkv, backend="eager", fullgraph=True)
    for _ in range(2):  # and the group waits for no one after a step, so it keeps sharing
        got = step(x)
        close(got[0], want[0])
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert not block.q._shared.diverged and block.q._shared._pending == set()
    assert _matmul_calls(lambda: qkv(x)) == 1  # eager: restacked
    block.to(torch.float64)  # a cast moves no weight buffer: the stack stays the members'
    got, counts = _compiled_ops(qkv, x)
    assert counts == [1]


def test_compiled_model_keeps_groups_and_folded_head_norms(tmp_path):
    """A Qwen3 with 128-wide heads, grouped and folded: compiled whole (one graph), four products
    a layer, head norms built in the graph, logits equal to the eager model's."""
    from escha.model import QuantizeOptions, load_model, quantize_model
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=128, vocab_size=256, max_position_embeddings=128)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(tmp_path / "src")
    quantize_model(str(tmp_path / "src"), str(tmp_path / "q"),
                   QuantizeOptions(bits=2, encoder="greedy", use_hessian=False, seq_len=32, progress=False))
    model = load_model(str(tmp_path / "q"), device="cpu")
    assert model.model.layers[0].self_attn.q_proj.head_norm is not None
    set_matmul_path(model, "reference")
    ids = torch.tensor([[3, 17, 99, 42, 7]])
    with torch.no_grad():
        want = model(ids).logits
        got, counts = _compiled_ops(lambda i: model(i).logits, ids, fullgraph=False)
    assert counts == [2 * 4]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# -- GPU: the kernels, eager and in a CUDA graph ---------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8, 40, 64])  # the decode range: fp16 operands
def test_group_on_the_gpu_in_a_cuda_graph(m):
    """q, k, v of Qwen3-14B's widths stacked (7168 rows): each member's rows of the one product,
    eager and replayed from a CUDA graph (poisoned first), against the members run alone and fp64."""
    stacked = random_qweight(5120 + 1024 + 1024, 5120, 2, seed=5, device="cuda")
    parts = split_rows(stacked, [5120, 1024, 1024])
    block = nn.Module()
    for name, part in zip("qkv", parts):
        setattr(block, name, EschaLinear.from_quantized(part.clone()))
    x = torch.randn(m, 5120, device="cuda", dtype=torch.bfloat16)
    alone = [getattr(block, n)(x) for n in "qkv"]
    assert share_inputs(block) == 1
    eager = [getattr(block, n)(x) for n in "qkv"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        graphed = [getattr(block, n)(x) for n in "qkv"]
    for y in graphed:
        y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert not block.q._shared.diverged
    for n, a, e, gr in zip("qkv", alone, eager, graphed):
        assert torch.equal(e, gr)  # the graph replays the same kernels
        ref = x.double() @ dequantize(getattr(block, n).qweight).double().T
        for y in (a, e):
            rel = float((y.double() - ref).norm() / ref.norm())
            assert rel < 2 * (2.0**-8 + 2.0**-11), (n, rel)  # bf16 output, fp16 operands (tolerance table)
