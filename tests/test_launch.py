"""common.prepare and Prepared: a launch through Triton, kept to run again with new tensors.

decode_wgmma keeps its three launches per (weight, layout of x, settings) and later calls only
run them again; the GPU tests check that such a call is bit for bit the call that made the plan,
with fresh inputs and poisoned outputs, and that what the plan fixed (x's alignment and strides,
the norms, a caller's output) makes a plan of its own.
"""
import pytest
import torch
import triton
import triton.language as tl

from escha.kernels.common import prepare


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, PLUS: tl.constexpr = 1.0):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) * a + PLUS, mask=i < n)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_prepare_runs_the_kernel():
    x = torch.randn(300, device=_device())
    y = torch.full_like(x, float("nan"))
    prepared = prepare(_axpb_kernel, (3,), x, y, 300, 0.5, BLOCK=128, slots=("x_ptr", "y_ptr"))
    torch.testing.assert_close(y, x * 0.5 + 1.0, rtol=0, atol=1e-6)
    assert (prepared is None) == (x.device.type == "cpu")  # nothing compiled to keep off the GPU


@pytest.mark.gpu
def test_prepared_runs_again_with_new_tensors():
    x = torch.randn(1000, device="cuda")
    y = torch.empty_like(x)
    prepared = prepare(_axpb_kernel, (8,), x, y, 1000, -2.0, BLOCK=128, PLUS=3.0, slots=("x_ptr", "y_ptr"))
    assert prepared.values[0] is None and prepared.values[1] is None  # it keeps no per-call tensor
    for _ in range(3):
        x2 = torch.randn(1000, device="cuda")
        y2 = torch.full_like(x2, float("nan"))
        prepared.run(x2, y2)
        torch.testing.assert_close(y2, x2 * -2.0 + 3.0, rtol=0, atol=1e-6)


def _decode_cases():
    from escha.norm import HeadNorm, RowNorm
    dev = torch.device("cuda")
    norm = RowNorm(torch.rand(1024, device=dev, dtype=torch.bfloat16) + 0.5, 1e-6)
    head = HeadNorm(torch.rand(512, device=dev, dtype=torch.bfloat16) + 0.5,
                    torch.tensor([1, 0, 1, 0], dtype=torch.int8, device=dev), 1e-6)
    return [
        ("M=1", lambda: torch.randn(1, 1024, device=dev, dtype=torch.bfloat16), {}),
        ("M=16 fp16", lambda: torch.randn(16, 1024, device=dev, dtype=torch.float16), {}),
        ("M=40 fp32", lambda: torch.randn(40, 1024, device=dev), {}),
        ("norms", lambda: torch.randn(3, 1024, device=dev, dtype=torch.bfloat16), {"norm": norm, "head_norm": head}),
        ("strided x", lambda: torch.randn(4, 2048, device=dev, dtype=torch.bfloat16)[:, ::2], {}),
        # a fresh buffer each time: x' calls must not share memory
        ("misaligned x", lambda: torch.randn(8 * 1024 + 8, device=dev, dtype=torch.bfloat16)[1:1 + 8 * 1024].view(8, 1024),
         {}),
    ]


@pytest.mark.gpu
def test_decode_wgmma_plans_are_bit_for_bit_the_first_call():
    from escha.format import random_qweight
    from escha.kernels.decode_wgmma import _packed, decode_wgmma, runs_on
    if not runs_on(torch.device("cuda"), 2):
        pytest.skip("needs a Hopper GPU")
    qw = random_qweight(512, 1024, bits=2, seed=7, device="cuda")
    plans = _packed(qw).plans
    for label, make_x, kwargs in _decode_cases():
        before = len(plans)
        x = make_x()
        first = decode_wgmma(x, qw, **kwargs)  # through Triton: makes this key's plan
        assert len(plans) == before + 1, label
        for _ in range(2):
            again = decode_wgmma(x, qw, **kwargs)  # the plan (a fresh, unwritten output)
            assert torch.equal(again, first), label
        assert len(plans) == before + 1, label
        x2 = make_x()
        out = torch.full((x2.shape[0], 512), float("nan"), device="cuda", dtype=x2.dtype)
        y2 = decode_wgmma(x2, qw, out=out, **kwargs)  # a caller's output: a plan of its own
        assert y2.data_ptr() == out.data_ptr() and torch.isfinite(y2).all(), label
        plans.clear()
        assert torch.equal(decode_wgmma(x2, qw, **kwargs), y2), label  # Triton's path again, same bits


def _replays(graphs: dict):
    """The graphs an op keeps for a weight, over every stream (common.replayed's dict)."""
    return [r for kept in graphs.values() for r in kept.values() if r is not None]


def _count(graphs: dict) -> int:
    return len(_replays(graphs))


@pytest.mark.gpu
def test_decode_wgmma_replays_are_bit_for_bit_the_launches():
    """From a key's second eager call on a stream on, the three launches are one CUDA graph
    replayed over the stream's arena: fresh inputs give the bits of the same plan launched into a caller's
    output (which never replays), earlier results are not overwritten, a larger call grows the
    arena and the smaller key's graph is captured again, and calls inside a capture or on
    another stream do not replay this stream's graphs."""
    from escha.format import random_qweight
    from escha.kernels.common import stream_arena
    from escha.kernels.decode_wgmma import _packed, decode_wgmma, runs_on
    if not runs_on(torch.device("cuda"), 2):
        pytest.skip("needs a Hopper GPU")
    qw = random_qweight(512, 1024, bits=2, seed=9, device="cuda")
    packed = _packed(qw)

    def launched(x, **kwargs):  # the plan's own launches (a caller's output is never replayed)
        out = torch.full((x.shape[0], 512), float("nan"), device="cuda", dtype=x.dtype)
        return decode_wgmma(x, qw, out=out, **kwargs)

    for label, make_x, kwargs in _decode_cases():
        if label == "strided x":
            continue  # not the arena's layout: never replayed (checked below)
        decode_wgmma(make_x(), qw, **kwargs)  # the plan
        graphs = _count(packed.graphs)
        xs = [make_x() for _ in range(3)]
        ys = [decode_wgmma(x, qw, **kwargs) for x in xs]  # noted, captured, replayed
        assert _count(packed.graphs) == graphs + 1, label
        for x, y in zip(xs, ys):  # each result intact after the later calls
            assert torch.isfinite(y).all() and torch.equal(y, launched(x, **kwargs)), label
        assert len({y.data_ptr() for y in ys}) == 3, label
    strided = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)[:, ::2]
    graphs = _count(packed.graphs)
    for _ in range(3):
        assert torch.equal(decode_wgmma(strided, qw), launched(strided))
    assert _count(packed.graphs) == graphs

    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    arena = stream_arena(torch.device("cuda"), stream)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    decode_wgmma(x, qw)
    replay = next(r for r in _replays(packed.graphs) if r.x.shape[0] == 1 and r.arena is arena)
    stream_arena(torch.device("cuda"), stream, arena.buffer.numel() + 1)  # as a larger weight's capture does
    assert arena.generation == replay.generation + 1
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(decode_wgmma(x, qw), launched(x))  # captured again over the new buffer
    assert next(r for r in _replays(packed.graphs) if r.x.shape[0] == 1 and r.arena is arena).generation == arena.generation

    graphs = _count(packed.graphs)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        y_captured = decode_wgmma(x, qw)  # inside a capture: the plan's launches, captured
    x.copy_(torch.randn(1, 1024))
    outer.replay()
    assert torch.equal(y_captured, launched(x)) and _count(packed.graphs) == graphs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            y_side = decode_wgmma(x, qw)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y_side, launched(x)) and _count(packed.graphs) == graphs + 1  # its own arena and graph


@pytest.mark.gpu
def test_decode_fp8_replays_are_bit_for_bit_the_launches():
    """decode_fp8 keeps its launches as decode_wgmma does (in ``weight_plans``) and replays them
    from a key's second eager call: fresh inputs give the bits of the plan launched into a
    caller's output, earlier results survive later calls, and x with rows not contiguous is
    launched, not replayed."""
    from escha.format import random_qweight
    from escha.kernels.common import weight_plans
    from escha.kernels.decode_fp8 import _GRAPHS, decode_fp8
    from escha.kernels.decode_wgmma import runs_on
    from escha.norm import HeadNorm, RowNorm
    if not runs_on(torch.device("cuda"), 2):
        pytest.skip("needs a Hopper GPU")
    dev = torch.device("cuda")
    qw = random_qweight(512, 1024, bits=2, seed=13, device=dev)
    plans = weight_plans(qw)
    norm = RowNorm(torch.rand(1024, device=dev, dtype=torch.bfloat16) + 0.5, 1e-6)
    head = HeadNorm(torch.rand(512, device=dev, dtype=torch.bfloat16) + 0.5,
                    torch.tensor([1, 0, 1, 0], dtype=torch.int8, device=dev), 1e-6)
    cases = [("M=100", lambda: torch.randn(100, 1024, device=dev, dtype=torch.bfloat16), {}),
             ("M=256 fp16", lambda: torch.randn(256, 1024, device=dev, dtype=torch.float16), {}),
             ("M=130 fp32", lambda: torch.randn(130, 1024, device=dev), {}),
             ("norms", lambda: torch.randn(70, 1024, device=dev, dtype=torch.bfloat16), {"norm": norm, "head_norm": head}),
             ("misaligned x",  # a fresh buffer each time: the calls' inputs must not share memory
              lambda: torch.randn(200 * 1024 + 8, device=dev, dtype=torch.bfloat16)[1:1 + 200 * 1024].view(200, 1024),
              {})]

    def graphs() -> int:
        return _count(plans.get(_GRAPHS, {}))

    def launched(x, **kwargs):  # the plan's own launches (a caller's output is never replayed)
        out = torch.full((x.shape[0], 512), float("nan"), device=dev, dtype=x.dtype)
        return decode_fp8(x, qw, out=out, **kwargs)

    for label, make_x, kwargs in cases:
        first = make_x()
        y_first = decode_fp8(first, qw, **kwargs)  # through Triton: the plan
        before = graphs()
        xs = [make_x() for _ in range(3)]
        ys = [decode_fp8(x, qw, **kwargs) for x in xs]  # noted, captured, replayed
        assert graphs() == before + 1, label
        for x, y in zip([first] + xs, [y_first] + ys):
            assert torch.isfinite(y).all() and torch.equal(y, launched(x, **kwargs)), label
    strided = torch.randn(100, 2048, device=dev, dtype=torch.bfloat16)[:, ::2]
    before = graphs()
    for _ in range(3):
        assert torch.equal(decode_fp8(strided, qw), launched(strided))
    assert graphs() == before


@pytest.mark.gpu
def test_graphs_a_weight_keeps_are_bounded():
    """A weight keeps at most MAX_GRAPHS graphs an op a stream: past them, a new token count
    launches its plan (same bits) instead of capturing one more graph."""
    from escha.format import random_qweight
    from escha.kernels.common import MAX_GRAPHS
    from escha.kernels.decode_wgmma import _packed, decode_wgmma, runs_on
    if not runs_on(torch.device("cuda"), 2):
        pytest.skip("needs a Hopper GPU")
    qw = random_qweight(256, 512, bits=2, seed=5, device="cuda")
    graphs = _packed(qw).graphs
    for m in range(1, MAX_GRAPHS + 4):
        for _ in range(3):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            out = torch.empty((m, 256), device="cuda", dtype=torch.bfloat16)
            assert torch.equal(decode_wgmma(x, qw), decode_wgmma(x, qw, out=out))
        assert _count(graphs) == min(m, MAX_GRAPHS)
    side = torch.cuda.Stream()  # the bound is a stream's: another stream keeps graphs of its own
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.randn(MAX_GRAPHS + 3, 512, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):
            y = decode_wgmma(x, qw)
    torch.cuda.current_stream().wait_stream(side)
    assert _count(graphs) == MAX_GRAPHS + 1 and torch.equal(y, decode_wgmma(x, qw, out=torch.empty_like(y)))


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["decode_wgmma", "decode_fp8"])
def test_a_kept_plan_call_checks_its_norms(op_name):
    """The plan key holds the norms' dtypes, not their shapes: a call with a kept plan must still
    refuse norms the kernels cannot apply to this weight, with a one-line error, before launching."""
    import importlib
    from escha.format import random_qweight
    from escha.kernels.decode_wgmma import runs_on
    from escha.norm import HeadNorm, RowNorm
    if not runs_on(torch.device("cuda"), 2):
        pytest.skip("needs a Hopper GPU")
    op = getattr(importlib.import_module(f"escha.kernels.{op_name}"), op_name)
    qw = random_qweight(256, 512, bits=2, seed=8, device="cuda")
    x = torch.randn(100 if op_name == "decode_fp8" else 4, 512, device="cuda", dtype=torch.bfloat16)
    good = RowNorm(torch.rand(512, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-6)
    head = HeadNorm(torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5,
                    torch.tensor([1, 0], dtype=torch.int8, device="cuda"), 1e-6)
    for _ in range(3):  # kept, then replayed
        y = op(x, qw, norm=good, head_norm=head)
    wide = RowNorm(torch.rand(640, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-6)
    with pytest.raises(ValueError, match=f"{op_name}: the norm's weight must be a \\[512\\]"):
        op(x, qw, norm=wide)
    other = HeadNorm(torch.rand(384, device="cuda", dtype=torch.bfloat16) + 0.5,
                     torch.tensor([1, 0, 1], dtype=torch.int8, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match=f"{op_name}: the head norm's weight must be a contiguous \\[256\\]"):
        op(x, qw, head_norm=other)
    assert torch.equal(op(x, qw, norm=good, head_norm=head), y)


def test_arena_views_are_aligned_and_apart():
    """The arena's parts start at multiples of 256 bytes and do not overlap; a request longer
    than the arena makes a new generation (CPU: the same code as on a GPU, without graphs)."""
    from escha.kernels.common import ARENA_MIN_BYTES, arena_bytes, arena_views, stream_arena
    parts = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2, 3, 4), torch.float16), ((1,), torch.uint8)]
    cpu = torch.device("cpu")
    arena = stream_arena(cpu, 12345)
    first = arena.generation
    assert arena.buffer.numel() >= ARENA_MIN_BYTES and stream_arena(cpu, 12345, 100) is arena
    assert arena.generation == first
    views = arena_views(arena, parts)
    base = arena.buffer.data_ptr()
    spans = [(v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size()) for v in views]
    assert all(a % 256 == 0 for a, _ in spans) and all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    assert [tuple(v.shape) for v in views] == [p[0] for p in parts] and spans[-1][1] <= arena_bytes(parts)
    assert stream_arena(cpu, 12345, 3 * ARENA_MIN_BYTES).generation == first + 1
    assert arena.buffer.numel() == 4 * ARENA_MIN_BYTES


@pytest.mark.gpu
@pytest.mark.parametrize("op_name", ["dequant_fp8", "dequant_bf16", "dequant_core_fp8", "dequant_core_bf16"])
def test_dequantize_once_plans_are_bit_for_bit_the_first_call(op_name):
    import escha.kernels.dequant_once as dq
    from escha.format import random_qweight
    from escha.kernels.common import weight_plans
    op = getattr(dq, op_name)
    qw = random_qweight(384, 1024, bits=3, seed=11, device="cuda")
    plans = weight_plans(qw)
    dev = torch.device("cuda")
    big = torch.randn(200 * 1024 + 8, device=dev, dtype=torch.bfloat16)
    cases = [("M=130 bf16", lambda: torch.randn(130, 1024, device=dev, dtype=torch.bfloat16)),
             ("M=200 fp16", lambda: torch.randn(200, 1024, device=dev, dtype=torch.float16)),
             ("M=97 fp32", lambda: torch.randn(97, 1024, device=dev)),
             ("strided rows", lambda: torch.randn(150, 2048, device=dev, dtype=torch.bfloat16)[:, :1024]),
             ("column stride 2", lambda: torch.randn(150, 2048, device=dev, dtype=torch.bfloat16)[:, ::2]),
             ("misaligned x", lambda: big[1:1 + 100 * 1024].view(100, 1024))]
    for label, make_x in cases:
        before = len(plans)
        x = make_x()
        first = op(x, qw)  # through Triton: makes this key's plan
        assert len(plans) == before + 1, label
        for _ in range(2):
            assert torch.equal(op(x, qw), first), label  # the plan, fresh outputs
        assert len(plans) == before + 1, label
        plans.clear()
        assert torch.equal(op(x, qw), first), label


# -- what a kept launch holds (CPU: Prepared over a recording stand-in for a compiled kernel) --------
class _Recorder:
    """Stands in for a compiled kernel: ``rec[grid](*args)`` records its arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


def test_run_kept_launches_the_three_over_fresh_tensors_of_its_parts():
    """Where a call is not replayed (here: into a caller's out), ``run_kept`` allocates x', 2**-e
    and the partials as ``parts`` lists them and hands each launch its slots in order: x, x', 2**-e
    and the norm's weight; x''s operand and the partials; the partials, y, 2**-e and the head norm's
    weight and flags (y twice without one)."""
    from escha.kernels.common import Prepared
    from escha.kernels.transforms import KeptPlan, run_kept
    from escha.norm import HeadNorm, RowNorm
    recs = [_Recorder() for _ in range(3)]
    plan = KeptPlan(3, *(Prepared(r, (1,), [None] * n, slots=tuple(range(n))) for r, n in zip(recs, (4, 2, 5))))
    x2d = torch.randn(5, 256)
    parts = [((5, 256), x2d.dtype), ((16, 384), torch.float16), ((5,), torch.float32), ((3, 16, 512), torch.float32),
             ((5, 500), x2d.dtype)]
    for norm, head_norm in ((None, None), (RowNorm(torch.randn(256), 1e-6),
                                           HeadNorm(torch.randn(512), torch.ones(4, dtype=torch.int8), 1e-6))):
        for r in recs:
            r.calls.clear()
        out = torch.full((5, 500), float("nan"))
        y = run_kept(plan, ("k",), {}, x2d, out, norm, head_norm, lambda: parts, lambda xq: ("operand", xq))
        assert y is out
        (_, (x_, xq, inv, nw)), = recs[0].calls
        (_, ((tag, xq_g), ws)), = recs[1].calls
        (_, (ws_o, y_o, inv_o, hw, hb)), = recs[2].calls
        assert x_ is x2d and nw is (x2d if norm is None else norm.weight)
        assert (xq.shape, xq.dtype, inv.shape, inv.dtype, ws.shape, ws.dtype) == (
            (16, 384), torch.float16, (5,), torch.float32, (3, 16, 512), torch.float32)
        assert tag == "operand" and xq_g is xq and ws_o is ws and y_o is out and inv_o is inv
        assert (hw, hb) == ((out, out) if head_norm is None else (head_norm.weight, head_norm.blocks))
    with pytest.raises(ValueError, match="out must be"):
        run_kept(plan, ("k",), {}, x2d, torch.empty(5, 499), None, None, lambda: parts, lambda xq: xq)


def test_prepared_holds_weak_arguments_by_reference_only():
    import weakref
    from escha.kernels.common import Prepared
    rec, t, per_call = _Recorder(), torch.zeros(4), torch.ones(2)
    p = Prepared(rec, (2,), [t, per_call, 3], slots=(1,), weak=(0,))
    assert p.values[1] is None  # the per-call tensor is not kept
    new = torch.ones(3)
    p.run(new)
    assert rec.calls[-1][0] == (2, 1, 1) and rec.calls[-1][1][0] is t and rec.calls[-1][1][1] is new
    ref = weakref.ref(t)
    del t
    rec.calls.clear()  # the record of the launch holds its arguments
    assert ref() is None  # the plan kept nothing alive
    with pytest.raises(RuntimeError, match="outlived"):
        p.run(new)


def test_weight_plans_go_with_the_trellis():
    """A plan kept per weight that holds its trellis weakly (as the dequantize-once paths' do)
    lets the weight die, and its plans with it; held strongly, neither would ever die."""
    import gc
    import weakref
    from escha.format import random_qweight
    from escha.kernels import common
    from escha.kernels.common import Prepared, weight_plans
    for weak, freed in (((0,), True), ((), False)):
        qw = random_qweight(128, 128, 2, seed=1)
        key, ref = id(qw.trellis), weakref.ref(qw.trellis)
        weight_plans(qw)["plan"] = Prepared(_Recorder(), (1,), [qw.trellis, None], slots=(1,), weak=weak)
        del qw
        gc.collect()
        assert (ref() is None) == freed and (key not in common._WEIGHT_PLANS) == freed
        common._WEIGHT_PLANS.pop(key, None)  # the strongly held case leaks by design: clean up


def test_prepare_checks_its_parameter_names_first():
    """A slot or weak name the kernel lacks fails before the launch, on every device; the names
    the dequantize-once paths keep exist."""
    from escha.kernels.common import _signature
    from escha.kernels.dequant import _dequant_kernel
    from escha.kernels.dequant_once import dequant_hn_kernel
    x, y = torch.zeros(4), torch.full((4,), -1.0)
    for bad, match in ((dict(slots=("x_ptr", "z_ptr")), "has no parameter"),
                       (dict(slots=("x_ptr",), weak=("w_ptr",)), "has no parameter"),
                       (dict(slots=None, weak=("w_ptr",)), "has no parameter"),
                       (dict(slots=("x_ptr",), weak=("x_ptr",)), "both a slot")):
        with pytest.raises(ValueError, match=match):
            prepare(_axpb_kernel, (1,), x, y, 4, 2.0, BLOCK=4, **bad)
        assert (y == -1).all()  # nothing launched
    names = {k: [n for n, _ in _signature(k)] for k in (_dequant_kernel, dequant_hn_kernel)}
    assert {"tr_ptr", "out_ptr"} <= set(names[_dequant_kernel])
    assert {"tr_ptr", "w_ptr", "wscale_ptr"} <= set(names[dequant_hn_kernel])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["dequant-core-fp8", "dequant-fp8", "dequant-bf16"])
def test_a_weight_with_kept_plans_is_freed(path):
    """The dequantize-once paths keep their launches per weight; once the weight is gone, its
    trellis is freed and its plans dropped (the scratch fillers hold the trellis weakly)."""
    import gc
    import weakref
    import escha
    from escha.format import random_qweight
    from escha.kernels import common
    qw = random_qweight(384, 640, 2, seed=7, device="cuda")
    x = torch.randn(600, 640, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # the first call keeps the plans, the second runs them
        escha.matmul(x, qw, path=path)
    key, ref = id(qw.trellis), weakref.ref(qw.trellis)
    assert common._WEIGHT_PLANS.get(key)  # plans were kept
    del qw
    gc.collect()
    assert ref() is None and key not in common._WEIGHT_PLANS
