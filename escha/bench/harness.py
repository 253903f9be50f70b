"""The harness: every arm in one process, interleaved rounds, per-round correctness gates,
best-of configs. Device-agnostic: the timer is injected, so the logic runs on CPU in tests."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Protocol, Sequence

import torch

from . import roofline
from .arms import Arm
from .method import Spread, rotation_buffers, round_order
from .shapes import Shape


class Sampler(Protocol):
    """A prepared timing of one candidate: each ``sample()`` is one timing sample, in us per call."""

    def sample(self) -> float:
        """One timing sample, in microseconds per call."""
        ...


class Timer(Protocol):
    """Prepares a sampler that calls ``fn(i)`` once for each rotation buffer ``i``."""

    def build(self, fn: Callable[[int], Any], n_buffers: int, label: str) -> Sampler:
        """A sampler calling ``fn(i)`` for i in range(n_buffers); ``label`` names the candidate."""
        ...


class Gate(str, Enum):
    """A candidate's accuracy gate against the fp64 reference: within its tolerance, or not."""

    PASS = "pass"
    FAIL = "fail"


class Status(str, Enum):
    """A candidate's fate: timed (pass), refused by its gate (fail), or unable to run (error)."""

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"


Log = Callable[[str], None]


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in fp32; inf for a wrong shape or a non-finite result."""
    if tuple(y.shape) != tuple(ref.shape):
        return math.inf
    y = y.float()
    num = torch.linalg.vector_norm(y - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if not math.isfinite(num):
        return math.inf
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


@dataclass
class Candidate:
    """One (arm, config) pair at one point, with its rotated states and its reference."""

    arm: Arm
    config: dict[str, Any]
    states: list[Any]
    x: Any
    ref: torch.Tensor
    sampler: Sampler | None = None
    samples: list[float] = field(default_factory=list)
    rel_err: float = 0.0
    status: Status = Status.PASS
    error: str | None = None

    @property
    def label(self) -> str:
        """The arm's name, with the config as ``name[k=v,...]`` when it has one (for logs and timers)."""
        cfg = ",".join(f"{k}={v}" for k, v in self.config.items())
        return f"{self.arm.name}[{cfg}]" if cfg else self.arm.name

    def gate(self) -> bool:
        """Re-check buffer 0 against the reference; a failure discards every sample so far."""
        try:
            err = rel_error(self.arm.run(self.states[0], self.x), self.ref)
        except Exception as e:
            self.status, self.error, self.samples = Status.ERROR, f"{type(e).__name__}: {e}", []
            return False
        self.rel_err = max(self.rel_err, err)
        if not err <= self.arm.meta.tolerance:  # NaN-safe: NaN fails
            self.status, self.samples = Status.FAIL, []
            return False
        return True


@dataclass
class Row:
    """One arm at one (shape, M): its best passing config, or a refusal. Times in microseconds;
    NaN (null in JSON) when the gate refused timing."""

    shape: str
    N: int
    K: int
    M: int
    arm: str
    us: float
    us_min: float
    us_max: float
    config: dict[str, Any]
    gate: Gate
    rel_err: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Skip:
    """An arm that did not run at a point, and why."""

    shape: str
    M: int
    arm: str
    reason: str


def _row_for(shape: Shape, M: int, arm: Arm, cands: Sequence[Candidate], n_buffers: int,
             info: roofline.DeviceInfo | None) -> Row | None:
    passing = [c for c in cands if c.status is Status.PASS and c.samples]
    failing = [c for c in cands if c.status is Status.FAIL]
    if passing:
        best = min(passing, key=lambda c: Spread.of(c.samples).median)
        gate = Gate.PASS
    elif failing:
        best = min(failing, key=lambda c: c.rel_err)
        gate = Gate.FAIL
    else:
        return None
    spread = Spread.of(best.samples) if gate is Gate.PASS else Spread.of([])
    wbits = arm.weight_bits(shape.N, shape.K)
    extra: dict[str, Any] = {
        "buffers": n_buffers,
        "working_set_bytes": n_buffers * shape.N * shape.K * wbits / 8,
        "tried": [{"config": c.config, "status": c.status.value, "rel_err": c.rel_err,
                   "us": Spread.of(c.samples).median, **({"error": c.error} if c.error else {})}
                  for c in cands],
    }
    nbytes = roofline.bytes_moved(shape.N, shape.K, M, wbits, arm.meta.act_bytes, arm.meta.out_bytes)
    extra["bytes"] = nbytes
    extra["tflops"] = roofline.tflops(shape.N, shape.K, M, spread.median)
    if info is not None:
        extra["floor_mem_us"] = roofline.memory_floor_us(nbytes, info.copy_bw)
        ops = arm.meta.int_ops_per_weight
        extra["floor_codec_us"] = (roofline.codec_floor_us(shape.N, shape.K, ops, info.sms, info.clock_hz)
                                   if ops is not None else None)
    return Row(shape.name, shape.N, shape.K, M, arm.name, spread.median, spread.low, spread.high,
               best.config, gate, best.rel_err, extra)


def measure_point(shape: Shape, M: int, arms: Sequence[Arm], *, timer: Timer, rounds: int,
                  l2_bytes: int, device: torch.device | str = "cuda", seed: int = 0,
                  info: roofline.DeviceInfo | None = None, log: Log = print) -> tuple[list[Row], list[Skip]]:
    """Measure every arm at (shape, M): prepare rotated weights, build one sampler per
    (arm, config), then ``rounds`` interleaved rounds in rotated order, gating each
    candidate immediately before each of its timing samples."""
    skips: list[Skip] = []
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, shape.K, generator=gen).to(device=device, dtype=torch.bfloat16)

    groups: list[tuple[Arm, list[Candidate], int]] = []
    for arm in arms:
        reason = arm.unavailable()
        if reason:
            skips.append(Skip(shape.name, M, arm.name, reason))
            continue
        try:
            concrete = arm.expand(shape.N, shape.K, M, device)
        except Exception as e:
            skips.append(Skip(shape.name, M, arm.name, f"expand failed: {type(e).__name__}: {e}"))
            continue
        for a in concrete:
            wbytes = a.weight_bits(shape.N, shape.K) * shape.N * shape.K / 8
            n_buf = rotation_buffers(l2_bytes, wbytes)
            try:
                states = [a.prepare(shape.N, shape.K, M, device) for _ in range(n_buf)]
                xa = a.make_input(states[0], x)
                ref = a.reference(states[0], xa).float()
            except Exception as e:
                skips.append(Skip(shape.name, M, a.name, f"prepare failed: {type(e).__name__}: {e}"))
                continue
            cands = []
            for cfg in a.configs():
                cstates = [a.configure(s, cfg) for s in states]
                cands.append(Candidate(a, dict(cfg), cstates, xa, ref))
            groups.append((a, cands, n_buf))

    flat = [c for _, cands, _ in groups for c in cands]
    for c in flat:
        # Gate before building: a wrong kernel is never captured, let alone timed.
        if not c.gate():
            log(f"  {shape.name} M={M} {c.label}: {c.status.value} rel_err={c.rel_err:.3g} {c.error or ''}")
            continue
        try:
            c.sampler = timer.build(lambda i, c=c: c.arm.run(c.states[i], c.x), len(c.states), c.label)
        except Exception as e:
            c.status, c.error = Status.ERROR, f"timer build failed: {type(e).__name__}: {e}"
            log(f"  {shape.name} M={M} {c.label}: {c.error}")

    for r in range(rounds):
        for idx in round_order(len(flat), r):
            c = flat[idx]
            if c.status is not Status.PASS:
                continue
            if not c.gate():  # re-gated immediately before this sample
                log(f"  {shape.name} M={M} {c.label}: gate {c.status.value} in round {r}, rel_err={c.rel_err:.3g}")
                continue
            c.samples.append(float(c.sampler.sample()))

    rows = []
    for a, cands, n_buf in groups:
        row = _row_for(shape, M, a, cands, n_buf, info)
        if row is None:
            errors = "; ".join(sorted({c.error or "" for c in cands}))
            skips.append(Skip(shape.name, M, a.name, errors or "no candidate ran"))
        else:
            rows.append(row)
    return rows, skips


def run_benchmark(shapes: Sequence[Shape], ms: Sequence[int], arms: Sequence[Arm], *, timer: Timer,
                  rounds: int, l2_bytes: int, device: torch.device | str = "cuda", seed: int = 0,
                  info: roofline.DeviceInfo | None = None, log: Log = print,
                  after_point: Callable[[list[Row], list[Skip]], None] | None = None
                  ) -> tuple[list[Row], list[Skip]]:
    """Every point in order (shape-major); all arms interleaved within each point.

    ``after_point(rows, skips)`` sees everything measured so far after each point.
    """
    rows: list[Row] = []
    skips: list[Skip] = []
    for shape in shapes:
        for M in ms:
            log(f"{shape.name} N={shape.N} K={shape.K} M={M}")
            r, s = measure_point(shape, M, arms, timer=timer, rounds=rounds, l2_bytes=l2_bytes,
                                 device=device, seed=seed, info=info, log=log)
            rows += r
            skips += s
            if after_point is not None:
                after_point(rows, skips)
    return rows, skips
