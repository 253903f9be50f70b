"""What an arm is: one way of computing y = x @ W^T, with its own weights and its own reference."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# bf16/fp16 outputs accumulated in fp32 land around 2-4e-3 relative error; a kernel
# bug (wrong layout, wrong scale, a miscompiled config) lands at O(1).
DEFAULT_TOLERANCE = 1e-2


@dataclass(frozen=True)
class ArmMeta:
    """Static facts an arm reports for the roofline columns and the gate.

    Attributes:
        weight_bits: stored bits per weight, scales included.
        act_bytes: bytes per activation element read.
        out_bytes: bytes per output element written.
        tolerance: the correctness gate's bound on relative error.
        int_ops_per_weight: integer ops per weight for the codec floor; None when the
            arm has no codec (its weights are read, not computed).
    """

    weight_bits: float
    act_bytes: int = 2
    out_bytes: int = 2
    tolerance: float = DEFAULT_TOLERANCE
    int_ops_per_weight: float | None = None


class Arm:
    """Base arm. Subclasses set ``name`` and ``meta`` and implement prepare/run/reference.

    ``prepare`` is called once per rotation buffer; each call returns an independent
    weight set. ``make_input`` turns the shared bf16 activation into what ``run`` takes
    (fp16, or a quantized pair). ``reference`` returns fp32 ``x @ W_hat^T`` where W_hat is
    this arm's own dequantized weights, from the same input ``run`` receives.
    """

    name: str = "arm"
    meta: ArmMeta = ArmMeta(weight_bits=16.0)

    def unavailable(self) -> str | None:
        """Why this arm cannot run in this process (missing package or API), or None."""
        return None

    def expand(self, N: int, K: int, M: int, device: torch.device | str) -> list["Arm"]:
        """The concrete arms this entry stands for at one point (a wildcard may expand)."""
        return [self]

    def weight_bits(self, N: int, K: int) -> float:
        """Stored bits per weight for an N x K matrix (sizes the rotation)."""
        return self.meta.weight_bits

    def configs(self) -> list[dict[str, Any]]:
        """The tuning space: each config is gated and timed, the best passing one reported."""
        return [{}]

    def configure(self, state: Any, config: dict[str, Any]) -> Any:
        """The state ``run`` uses under ``config`` (default: configs do not touch state)."""
        return state

    def prepare(self, N: int, K: int, M: int, device: torch.device | str) -> Any:
        """A new, independent weight set (the state ``run`` takes) for an N x K matrix at M rows on ``device``;
        raises when the arm cannot run this point, which the harness then skips."""
        raise NotImplementedError

    def make_input(self, state: Any, x: torch.Tensor) -> Any:
        """Convert the bf16 activation [M, K] to this arm's input (default: unchanged)."""
        return x

    def run(self, state: Any, x: Any) -> torch.Tensor:
        """The timed call: ``x @ W^T`` [M, N] from ``make_input``'s output and this state's weights."""
        raise NotImplementedError

    def reference(self, state: Any, x: Any) -> torch.Tensor:
        """fp32 ``x @ W_hat^T`` [M, N] from the input ``run`` takes, W_hat this state's dequantized weights;
        the gate bounds ``run``'s relative error against it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
