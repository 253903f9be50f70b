"""Tensor parallelism: the parallel layers, and one checkpoint loaded by two gloo ranks
(tests/tp_worker.py, started as torchrun would) against the single-process model."""
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

import escha
from escha.format import random_qweight
from escha.format.shard import ShardError
from escha.nn.parallel import (ColumnParallelEschaLinear, ColumnParallelLinear, RowParallelEschaLinear,
                               RowParallelLinear, TPGroup)

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tp_worker  # noqa: E402

from escha.model import ModelError, QuantizeOptions, quantize_model  # noqa: E402
from escha.parallel import load_local, plan_placements, supported_tp_degrees  # noqa: E402

WORLD = 2
NEW_TOKENS = 6


# -- the parallel layers, one rank at a time (column layers need no communication) ------------------

def test_column_layers_concatenate_to_the_whole_layer():
    qw, bias = random_qweight(200, 300, seed=1), torch.randn(200)
    x = torch.randn(3, 300)
    whole = escha.EschaLinear.from_quantized(qw, bias)
    ys = [ColumnParallelEschaLinear.from_full(qw, bias, TPGroup(r, 2)) for r in range(2)]
    for m in [whole, *ys]:
        m.path = "reference"
    assert [m.out_features for m in ys] == [128, 72] and [m.in_features for m in ys] == [300, 300]
    torch.testing.assert_close(torch.cat([m(x) for m in ys], -1), whole(x), rtol=1e-5, atol=1e-5)
    dense = torch.nn.Linear(300, 200)
    ys = [ColumnParallelLinear.from_full(dense, TPGroup(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([m.weight for m in ys]), dense.weight)
    rows = [RowParallelEschaLinear.from_full(random_qweight(64, 256), bias[:64], TPGroup(r, 2)) for r in range(2)]
    assert [m.in_features for m in rows] == [128, 128] and all(torch.equal(m.bias, bias[:64]) for m in rows)
    assert [RowParallelLinear.from_full(dense, TPGroup(r, 3)).weight.shape[1] for r in range(3)] == [128, 128, 44]


# -- whole models -------------------------------------------------------------------------------------

FAST = QuantizeOptions(bits=2, encoder="greedy", use_hessian=False, seq_len=32, max_samples=2, progress=False)


def _tiny(kind: str, path: str, skip: tuple[str, ...] = ("lm_head",), **over) -> str:
    """A tiny random checkpoint whose split dimensions hold at least two 128-blocks."""
    torch.manual_seed(0)
    if kind == "llama":  # hidden 200: cropped outputs and a 72-row last block in the MLP; biases
        cfg = transformers.LlamaConfig(hidden_size=200, intermediate_size=200, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                       vocab_size=256, max_position_embeddings=256, attention_bias=True,
                                       mlp_bias=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":  # intermediate 456: shards of 256 and 200 rows; q/k norms; tied head
        cfg = transformers.Qwen3Config(**{**dict(hidden_size=256, intermediate_size=456, num_hidden_layers=2,
                                                 num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                                 vocab_size=256, max_position_embeddings=256,
                                                 tie_word_embeddings=True), **over})
        model = transformers.Qwen3ForCausalLM(cfg)
    else:  # Phi-3: fused qkv_proj [q | k | v] and gate_up_proj [gate | up]
        cfg = transformers.Phi3Config(hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=256, pad_token_id=0, eos_token_id=1)
        model = transformers.Phi3ForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises biases to zero and norm weights to one, which
        for m in model.modules():  # would hide a misplaced one
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
            elif "RMSNorm" in type(m).__name__ and getattr(m, "weight", None) is not None:
                m.weight.uniform_(0.5, 1.5)
    src, out = path + "-src", path
    model.eval().save_pretrained(src)
    quantize_model(src, out, dataclasses.replace(FAST, skip=skip))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    dirs = {k: _tiny(k, str(root / k)) for k in ("qwen3", "phi3")}
    # Llama keeps v_proj and down_proj dense: split dense layers (with biases) next to Escha ones.
    dirs["llama"] = _tiny("llama", str(root / "llama"), skip=("lm_head", "v_proj", "down_proj"))
    dirs["odd"] = _tiny("qwen3", str(root / "odd"), intermediate_size=320)  # 3 blocks: TP=1 only
    dirs["missing"] = str(root / "missing")
    shutil.copytree(dirs["llama"], dirs["missing"])
    os.remove(os.path.join(dirs["missing"], "model-00002-of-00003.safetensors"))
    return dirs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The collectives' timeout is far above the launch's: a rank left waiting would fail the test by
# the launch timeout, not be rescued by the process group's.
PG_TIMEOUT, LAUNCH_TIMEOUT = 600, 150


def launch(cases: list[dict], out: str) -> list[list[dict]]:
    """Run tests/tp_worker.py on WORLD gloo ranks, as torchrun would; each rank's results."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(WORLD),
               OMP_NUM_THREADS="1", ESCHA_TEST_PG_TIMEOUT=str(PG_TIMEOUT))
    procs = [subprocess.Popen([sys.executable, tp_worker.__file__, out, json.dumps(cases)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the ranks did not finish within {LAUNCH_TIMEOUT} s (a hang)")
    codes = [p.returncode for p in procs]
    assert codes == [0] * WORLD, f"the ranks exited with {codes}:\n" + "\n".join(
        f"--- rank {r}:\n{log[-3000:]}" for r, log in enumerate(logs))
    return [torch.load(f"{out}.rank{r}") for r in range(WORLD)]


MODELS = ("llama", "qwen3", "phi3")


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory):
    """One launch for every multi-rank case: the three models, then the bad inputs."""
    d = checkpoints
    cases = [{"kind": "model", "dir": d[k], "new_tokens": NEW_TOKENS, "static": k == "qwen3"} for k in MODELS]
    cases += [
        {"kind": "parallelize", "dir": d["qwen3"]},
        {"kind": "error", "dir": d["odd"]},
        {"kind": "error", "dirs": [d["llama"], d["qwen3"]]},
        {"kind": "error", "dir": d["missing"]},
        {"kind": "error", "dir": d["llama"], "devices": ["cpu", "no-such-device"]},
    ]
    t = time.monotonic()
    results = launch(cases, str(tmp_path_factory.mktemp("out") / "result"))
    return {"results": results, "seconds": time.monotonic() - t}


def _single(directory: str) -> dict:
    return tp_worker.outputs(escha.load_model(directory), NEW_TOKENS)


@pytest.mark.parametrize("i, kind", list(enumerate(MODELS)))
def test_two_ranks_match_the_single_process_model(checkpoints, ranks, i, kind):
    ref = _single(checkpoints[kind])
    # The fp32 rounding error the single-process model makes, against the same function in fp64
    # with exact weights. The split model runs the same fp32 operations with its sums ordered
    # differently (each row-parallel product summed in two halves, then all-reduced), so it lies
    # within about that error of the fp64 values too: its distance to the single-process logits
    # stays below twice the error, here allowed four times.
    err = float((ref["logits"].double() - ref["logits64"]).abs().max())
    assert 0 < err < 1e-4
    for rank, res in enumerate(ranks["results"]):
        out = res[i]
        assert torch.equal(out["tokens"], ref["tokens"]), (kind, rank)
        diff = float((out["logits"] - ref["logits"]).abs().max())
        assert diff <= 4 * err, (kind, rank, diff, err)
        # In fp64 with exact weights the split is exact up to fp64 rounding: any misplaced row,
        # column, head or bias would show here at full size.
        scale = float(ref["logits64"].abs().max())
        assert float((out["logits64"] - ref["logits64"]).abs().max()) <= 1e-12 * scale, (kind, rank)
    assert torch.equal(ranks["results"][0][i]["logits"], ranks["results"][1][i]["logits"])
    layers = {k.rpartition(".")[2]: v for k, v in ranks["results"][0][i]["layers"].items()}
    if kind == "phi3":
        want = {"qkv_proj": "Column", "gate_up_proj": "Column", "o_proj": "Row", "down_proj": "Row"}
    else:
        want = {"q_proj": "Column", "k_proj": "Column", "v_proj": "Column", "o_proj": "Row", "gate_proj": "Column",
                "up_proj": "Column", "down_proj": "Row"}
    dense = {"v_proj", "down_proj"} if kind == "llama" else set()
    assert layers == {k: f"{v}Parallel{'' if k in dense else 'Escha'}Linear" for k, v in want.items()}
    if kind == "qwen3":  # a StaticCache sized per rank by transformers from the recorded plan
        assert all(torch.equal(res[i]["tokens_static"], ref["tokens"]) for res in ranks["results"])


def test_a_model_split_in_memory_equals_the_one_loaded_split(ranks):
    for res in ranks["results"]:
        assert torch.equal(res[len(MODELS)]["logits"], res[1]["logits"])  # qwen3


def _errors(ranks, index):
    return [res[len(MODELS) + 1 + index] for res in ranks["results"]]


def test_a_world_size_that_does_not_divide_the_blocks_fails_on_every_rank(ranks):
    for e in _errors(ranks, 0):
        assert e["type"] == "ShardError"
        assert "mlp.gate_proj: cannot split the rows of a 320x256 weight over 2 ranks" in e["message"]
        assert "supported: 1, 3" in e["message"]


def test_ranks_reading_different_checkpoints_fail_on_every_rank(ranks):
    for e in _errors(ranks, 1):
        assert e["type"] == "ModelError" and "ranks are loading different checkpoints" in e["message"]


def test_a_missing_shard_file_fails_on_every_rank(ranks):
    for e in _errors(ranks, 2):
        assert e["type"] == "FileNotFoundError" and "model-00002-of-00003.safetensors" in e["message"]


def test_a_failure_on_one_rank_reaches_the_others(ranks):
    own, other = _errors(ranks, 3)[1], _errors(ranks, 3)[0]
    assert own["type"] == "DeviceError" and "no-such-device" in own["message"]
    assert other["type"] == "ModelError" and other["message"].startswith("rank 1 of 2 failed to load")
    assert ranks["seconds"] < LAUNCH_TIMEOUT


# -- one rank's load, in this process --------------------------------------------------------------

class _SpyOpen:
    """Wraps safetensors.safe_open and records what is read whole and what by slices."""

    def __init__(self, real):
        self.real, self.whole, self.sliced = real, [], {}

    def __call__(self, *a, **k):
        spy, handle = self, self.real(*a, **k)

        class Slice:
            def __init__(self, key):
                self.key, self.sl = key, handle.get_slice(key)

            def __getitem__(self, index):
                t = self.sl[index]
                spy.sliced[self.key] = spy.sliced.get(self.key, 0) + t.numel()
                return t

            def __getattr__(self, name):
                return getattr(self.sl, name)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_tensor(self, key):
                spy.whole.append(key)
                return handle.get_tensor(key)

            def get_slice(self, key):
                return Slice(key)

        return Handle()


def test_one_rank_reads_only_its_blocks(checkpoints, monkeypatch):
    import safetensors
    spy = _SpyOpen(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", spy)
    d = checkpoints["llama"]
    shards = [load_local(d, TPGroup(r, WORLD)) for r in range(WORLD)]
    monkeypatch.undo()
    whole = escha.load_model(d)
    placements = plan_placements(whole)
    assert len(placements) == 14
    for name, p in placements.items():
        mods = [s.get_submodule(name) for s in shards]
        full = whole.get_submodule(name)
        if isinstance(full, escha.EschaLinear):
            assert torch.equal(torch.cat([m.dequantized_weight() for m in mods], p.dim), full.dequantized_weight())
            # Split weights are read by slices only, each rank its half of the trellis words.
            assert f"{name}.trellis" not in spy.whole and f"{name}.su" not in spy.whole
            assert spy.sliced[f"{name}.trellis"] == full.trellis.numel()
        else:  # a dense layer: the same block split, read by slices too
            assert torch.equal(torch.cat([m.weight for m in mods], p.dim), full.weight)
            assert f"{name}.weight" not in spy.whole and spy.sliced[f"{name}.weight"] == full.weight.numel()
        if p.dim == 0:
            assert torch.equal(torch.cat([m.bias for m in mods]), full.bias)
        else:
            assert all(torch.equal(m.bias, full.bias) for m in mods)
    # Everything else is whole on every rank.
    assert torch.equal(shards[1].model.embed_tokens.weight, whole.model.embed_tokens.weight)


def test_supported_degrees_follow_the_shapes(checkpoints):
    assert supported_tp_degrees(checkpoints["llama"]) == [1, 2]
    assert supported_tp_degrees(checkpoints["phi3"]) == [1, 2]
    assert supported_tp_degrees(checkpoints["odd"]) == [1]


@pytest.mark.parametrize("name, cfg, want", [
    ("Qwen3ForCausalLM", dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=40, num_key_value_heads=8,
                              head_dim=128), [1, 2, 4, 8]),  # Qwen3-14B
    ("LlamaForCausalLM", dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3),
     [1]),  # SmolLM2-135M: q has 5 blocks, k 2
    ("Phi3ForCausalLM", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=24, num_key_value_heads=8,
                             pad_token_id=0), [1, 2, 4, 8]),  # Phi-4-mini, fused qkv and gate_up
])
def test_supported_degrees_of_real_shapes(name, cfg, want):
    from escha.model.checkpoint import build_skeleton
    config = getattr(transformers, name.replace("ForCausalLM", "Config"))(num_hidden_layers=1, vocab_size=64, **cfg)
    config.architectures = [name]
    assert supported_tp_degrees(build_skeleton(config)) == want  # as docs/FORMAT.md section 11 lists


def test_load_model_without_a_process_group_is_single_process(checkpoints):
    model = escha.load_model(checkpoints["qwen3"])
    assert type(model.model.layers[0].mlp.down_proj) is escha.EschaLinear
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        escha.load_model(checkpoints["qwen3"], tensor_parallel=True)


def test_heads_must_split_evenly(checkpoints):
    # Qwen3's k_proj (2 heads of 128) has 2 blocks: no split over 4 ranks.
    with pytest.raises(ShardError, match="k_proj: cannot split the rows of a 256x256 weight over 4 ranks"):
        load_local(checkpoints["qwen3"], TPGroup(0, 4))
    # Blocks that divide but heads that do not: 3 heads of 256 rows are 6 blocks.
    from escha.model.checkpoint import build_skeleton
    from escha.parallel import _prepare
    cfg = transformers.Qwen3Config(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=3,
                                   num_key_value_heads=1, head_dim=256, vocab_size=64)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with pytest.raises(ModelError, match="num_attention_heads=3 does not divide by 2 ranks"):
        _prepare(build_skeleton(cfg), TPGroup(0, 2))
