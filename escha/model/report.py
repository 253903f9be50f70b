"""The ending report of a quantization run: per-layer error, bits and time."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..progress import format_bytes
from .options import LinearStats


@dataclass
class QuantizeReport:
    """What a run produced; ``to_json`` is written to OUT_DIR/escha_report.json."""

    mode: str  # "bits=2", "bits=3" or "bpw=2.5"
    bits_map: dict[str, int]
    stats: list[LinearStats]
    num_layers: int
    layer_seconds: dict[int, float] = field(default_factory=dict)
    resumed_layers: list[int] = field(default_factory=list)
    hessian: str = "used"
    calibration: dict = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    total_seconds: float = 0.0
    # Whole checkpoints only (quantize_model): bytes of the input and output tensor files and
    # the number of parameters of the model, quantized or not.
    input_bytes: int | None = None
    output_bytes: int | None = None
    checkpoint_params: int | None = None
    tune: dict | None = None  # escha.model.tune.result_json of a scale-tuning run, if one ran

    @property
    def params(self) -> int:
        """Weights over all quantized Linears."""
        return sum(s.params for s in self.stats)

    @property
    def mean_bits(self) -> float:
        """Parameter-weighted mean K over the quantized Linears."""
        return sum(self.bits_map[s.name] * s.params for s in self.stats) / max(1, self.params)

    @property
    def storage_bpw(self) -> float:
        """Stored bits per quantized weight, side information and padding included."""
        return sum(s.storage_bpw[self.bits_map[s.name]] * s.params for s in self.stats) / max(1, self.params)

    @property
    def checkpoint_bpw(self) -> float | None:
        """Stored bits per parameter of the whole output checkpoint (files' bytes over parameters)."""
        if not self.output_bytes or not self.checkpoint_params:
            return None
        return 8 * self.output_bytes / self.checkpoint_params

    def summary(self) -> list[str]:
        """The closing lines of ``escha quantize``: sizes, ratio, bits per weight."""
        lines = []
        if self.input_bytes and self.output_bytes:
            lines.append(f"input {format_bytes(self.input_bytes)}, output {format_bytes(self.output_bytes)}: "
                         f"{self.input_bytes / self.output_bytes:.1f}x smaller")
        lines.append(f"stored bits per weight: {self.storage_bpw:.3f} over the {len(self.stats)} quantized "
                     f"Linears ({self.params:,} weights, mean K {self.mean_bits:.2f})")
        if self.tune is not None and "error" in self.tune:
            lines.append(f"scale tuning: {self.tune['error']}")
        elif self.tune is not None:
            t = self.tune
            kept = (f"kept step {t['kept_step']}" if t["kept_step"] else
                    "no step did better on held-out samples, so the quantized scales were kept")
            lines.append(f"scale tuning: {t['steps']} steps over {t['scales']:,} row scales and {t['norm_weights']:,} "
                         f"norm weights, held-out KL {t['kl_before']:.4f} -> {t['kl_after']:.4f} nats a token "
                         f"({kept}; {t['seconds']:.0f} s)")
        whole = self.checkpoint_bpw
        if whole is not None:
            lines.append(f"stored bits per weight: {whole:.3f} over the whole checkpoint "
                         f"({self.checkpoint_params:,} parameters)")
            rest = self.checkpoint_params - self.params
            if rest > 0 and whole > self.storage_bpw + 0.05:
                lines.append(f"  (higher because the other {rest / self.checkpoint_params:.0%} of the parameters - "
                             f"embeddings, norms, the unquantized head - stay as stored in the input)")
        return lines

    def layer_rows(self) -> list[dict]:
        """One row per layer (the modules after the stack form a last "tail" row)."""
        rows = []
        for layer in sorted({s.layer for s in self.stats}):
            group = [s for s in self.stats if s.layer == layer]
            n = sum(s.params for s in group)
            k = lambda s: self.bits_map[s.name]  # noqa: E731
            rows.append({
                "layer": layer if layer < self.num_layers else "tail",
                "linears": len(group),
                "params": n,
                "mean_bits": sum(k(s) * s.params for s in group) / n,
                "storage_bpw": sum(s.storage_bpw[k(s)] * s.params for s in group) / n,
                "proxy_rel": sum(s.proxy_rel[k(s)] for s in group) / len(group),
                "weight_rel": sum(s.weight_rel[k(s)] for s in group) / len(group),
                "seconds": self.layer_seconds.get(layer, sum(s.seconds for s in group)),
                "resumed": layer in self.resumed_layers,
            })
        return rows

    def to_json(self) -> dict:
        """The report as written to escha_report.json: totals, per-layer rows and per-Linear stats with their K."""
        return {
            "mode": self.mode, "num_layers": self.num_layers, "params": self.params,
            "mean_bits": self.mean_bits, "storage_bpw": self.storage_bpw, "hessian": self.hessian,
            "calibration": self.calibration, "skipped": self.skipped,
            "total_seconds": self.total_seconds, "resumed_layers": self.resumed_layers,
            "input_bytes": self.input_bytes, "output_bytes": self.output_bytes,
            "checkpoint_params": self.checkpoint_params, "checkpoint_bpw": self.checkpoint_bpw,
            "tune": self.tune, "layers": self.layer_rows(),
            "linears": [{**s.to_json(), "bits": self.bits_map[s.name]} for s in self.stats],
        }

    def table(self) -> str:
        """A fixed-width table of the per-layer rows and the totals."""
        head = f"{'layer':>6} {'linears':>7} {'params':>12} {'K':>5} {'bpw':>6} {'proxy_rel':>10} {'w_rel':>8} {'sec':>8}"
        lines = [head, "-" * len(head)]
        for r in self.layer_rows():
            lines.append(f"{r['layer']!s:>6} {r['linears']:>7} {r['params']:>12,} {r['mean_bits']:>5.2f} "
                         f"{r['storage_bpw']:>6.3f} {r['proxy_rel']:>10.4f} {r['weight_rel']:>8.4f} "
                         f"{r['seconds']:>8.1f}{'  (resumed)' if r['resumed'] else ''}")
        lines.append("-" * len(head))
        lines.append(f"{'total':>6} {len(self.stats):>7} {self.params:>12,} {self.mean_bits:>5.2f} "
                     f"{self.storage_bpw:>6.3f} {'':>10} {'':>8} {self.total_seconds:>8.1f}")
        lines.append(f"mode {self.mode}; Hessian {self.hessian}; calibration {self.calibration}")
        return "\n".join(lines)
