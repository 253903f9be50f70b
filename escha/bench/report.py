"""Outputs: seed-style tables, results.json (stable schema), and a time-vs-M plot."""
from __future__ import annotations

import datetime as _dt
import json
import math
import subprocess
from pathlib import Path
from typing import Any, Sequence

from .harness import Row, Skip
from .shapes import DECODE_MAX_M, PREFILL_MIN_M

DECODE_BASELINE = "torch-bf16"
PREFILL_BASELINE = "torch-fp8"
ROW_KEYS: dict[str, tuple[type, ...]] = {
    "shape": (str,), "N": (int,), "K": (int,), "M": (int,), "arm": (str,),
    "us": (float, type(None)), "us_min": (float, type(None)), "us_max": (float, type(None)),
    "config": (dict,), "gate": (str,), "rel_err": (float, type(None)),
}
META_KEYS = ("gpu", "driver", "torch", "triton", "git_sha", "date")


def _clean(v: Any) -> Any:
    """JSON-safe: NaN and inf become null (JSON has no NaN)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def row_to_json(row: Row) -> dict[str, Any]:
    """The schema's keys first, then extras (roofline columns, buffers, configs tried)."""
    base = {"shape": row.shape, "N": row.N, "K": row.K, "M": row.M, "arm": row.arm,
            "us": row.us, "us_min": row.us_min, "us_max": row.us_max, "config": row.config,
            "gate": row.gate.value, "rel_err": float(row.rel_err)}
    return _clean({**base, **{k: v for k, v in row.extra.items() if k not in base}})


def git_sha(repo: Path | None = None) -> str:
    """HEAD of the repository holding this package (with -dirty when the tree differs), or "unknown".

    ESCHA_GIT_SHA, when set, wins: a copy of the tree without its .git (a remote benchmark
    machine) is told which commit it is.
    """
    import os
    if os.environ.get("ESCHA_GIT_SHA"):
        return os.environ["ESCHA_GIT_SHA"]
    cwd = repo or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=cwd, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def build_meta(*, gpu: str, driver: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The meta block: the required keys plus anything in ``extra``."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "unavailable"
    meta = {"gpu": gpu, "driver": driver, "torch": torch.__version__, "triton": triton_version,
            "git_sha": git_sha(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    meta.update(extra or {})
    return _clean(meta)


def results_doc(meta: dict[str, Any], rows: Sequence[Row], skips: Sequence[Skip]) -> dict[str, Any]:
    """The results.json document; skipped arms are listed in meta["skipped"]."""
    meta = dict(meta)
    meta["skipped"] = [{"shape": s.shape, "M": s.M, "arm": s.arm, "reason": s.reason} for s in skips]
    return {"meta": meta, "rows": [row_to_json(r) for r in rows]}


def validate_results(doc: Any) -> list[str]:
    """Every way ``doc`` departs from the results.json schema; empty when it conforms."""
    problems: list[str] = []
    if not isinstance(doc, dict) or set(doc) < {"meta", "rows"}:
        return ["top level must be an object with 'meta' and 'rows'"]
    meta, rows = doc["meta"], doc["rows"]
    if not isinstance(meta, dict):
        problems.append("meta must be an object")
    else:
        problems += [f"meta.{k} missing or not a string" for k in META_KEYS if not isinstance(meta.get(k), str)]
    if not isinstance(rows, list):
        return problems + ["rows must be a list"]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            problems.append(f"rows[{i}] must be an object")
            continue
        for key, types in ROW_KEYS.items():
            if key not in row:
                problems.append(f"rows[{i}].{key} missing")
            elif isinstance(row[key], bool) or not isinstance(row[key], types):
                problems.append(f"rows[{i}].{key} has type {type(row[key]).__name__}")
        gate = row.get("gate")
        if gate not in ("pass", "fail"):
            problems.append(f"rows[{i}].gate must be 'pass' or 'fail', got {gate!r}")
        elif gate == "pass" and not isinstance(row.get("us"), float):
            problems.append(f"rows[{i}] passed its gate but has no time")
        elif gate == "fail" and row.get("us") is not None:
            problems.append(f"rows[{i}] failed its gate but has a time")
    return problems


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as JSON (NaN and infinities refused: a result file must be valid JSON)."""
    path.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")


# -- tables ----------------------------------------------------------------------------
def _fmt_us(row: Row) -> str:
    if row.gate.value == "fail":
        return f"refused (gate, rel_err {row.rel_err:.2e})"
    return f"{row.us:.1f}"


def _ratio(row: Row, base: Row | None) -> str:
    if base is None or row.gate.value == "fail" or base.gate.value == "fail":
        return "–"
    return f"{row.us / base.us:.3f}×"


def render_tables(rows: Sequence[Row]) -> str:
    """Markdown: a decode table (M <= 64, ratio vs torch-bf16) and a prefill table
    (M >= 128, ratio vs torch-fp8, TFLOP/s). Ratios are arm time / baseline time."""
    out: list[str] = []
    index = {(r.shape, r.M, r.arm): r for r in rows}
    decode = [r for r in rows if r.M <= DECODE_MAX_M]
    prefill = [r for r in rows if r.M >= PREFILL_MIN_M]
    middle = [r for r in rows if DECODE_MAX_M < r.M < PREFILL_MIN_M]
    spread = lambda r: "–" if r.gate.value == "fail" else f"{r.us_min:.1f}–{r.us_max:.1f}"  # noqa: E731
    floor = lambda r: "–" if r.extra.get("floor_mem_us") is None else f"{r.extra['floor_mem_us']:.1f}"  # noqa: E731
    if decode:
        out += ["## Decode (µs)", "",
                f"| shape | M | arm | µs | min–max | vs {DECODE_BASELINE} | mem floor µs | gate rel_err |",
                "|---|---|---|---|---|---|---|---|"]
        for r in decode:
            out.append(f"| {r.shape} | {r.M} | {r.arm} | {_fmt_us(r)} | {spread(r)} | "
                       f"{_ratio(r, index.get((r.shape, r.M, DECODE_BASELINE)))} | {floor(r)} | {r.rel_err:.2e} |")
        out.append("")
    for title, part in (("Prefill (µs)", prefill), ("Between decode and prefill (µs)", middle)):
        if not part:
            continue
        out += [f"## {title}", "",
                f"| shape | M | arm | µs | min–max | vs {PREFILL_BASELINE} | TFLOP/s | gate rel_err |",
                "|---|---|---|---|---|---|---|---|"]
        for r in part:
            tf = r.extra.get("tflops")
            tf_s = "–" if tf is None or not math.isfinite(tf) else f"{tf:.1f}"
            out.append(f"| {r.shape} | {r.M} | {r.arm} | {_fmt_us(r)} | {spread(r)} | "
                       f"{_ratio(r, index.get((r.shape, r.M, PREFILL_BASELINE)))} | {tf_s} | {r.rel_err:.2e} |")
        out.append("")
    return "\n".join(out)


def render_skips(skips: Sequence[Skip]) -> str:
    """One line per distinct (arm, reason), with the points it covers counted."""
    if not skips:
        return ""
    counts: dict[tuple[str, str], int] = {}
    for s in skips:
        counts[(s.arm, s.reason)] = counts.get((s.arm, s.reason), 0) + 1
    lines = ["## Skipped", ""]
    lines += [f"- {arm}: {reason} ({n} point{'s' if n > 1 else ''})" for (arm, reason), n in counts.items()]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[Row], path: Path) -> str | None:
    """Time vs M per arm, one panel per shape, log-log. Returns a note when skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped (pip install escha[plot])"
    shapes = list(dict.fromkeys(r.shape for r in rows))
    if not shapes:
        return "no rows: plot skipped"
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for arm in dict.fromkeys(r.arm for r in rows if r.shape == shape):
            pts = sorted((r.M, r.us) for r in rows
                         if r.shape == shape and r.arm == arm and r.gate.value == "pass")
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=arm)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs")
        ax.set_title(shape)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
