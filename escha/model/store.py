"""Per-layer results under OUT_DIR/.partial/, so an interrupted run resumes where it stopped."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import safe_open

from ..format.qweight import QuantizedWeight
from ..io import load_file, save_file
from .errors import ModelError
from .options import LinearStats, dumps

PARTIAL_DIR = ".partial"
STATS_KEY = "escha_stats"


class PartialStore:
    """One atomically written safetensors file per finished layer, plus the run's identity.

    A file holds the layer's quantized Linears at every candidate K (named ``<module>@k<K>``),
    its other tensors as stored in the source checkpoint, and the Linears' statistics.
    """

    def __init__(self, out_dir: str, identity: dict) -> None:
        self.dir = os.path.join(out_dir, PARTIAL_DIR)
        os.makedirs(self.dir, exist_ok=True)
        ident_path = os.path.join(self.dir, "run.json")
        if os.path.isfile(ident_path):
            with open(ident_path, encoding="utf-8") as f:
                previous = json.load(f)
            if previous != json.loads(dumps(identity)):
                changed = sorted(k for k in set(previous) | set(identity) if previous.get(k) != identity.get(k))
                raise ModelError(f"{self.dir} holds partial results of a different run (differs in "
                                 f"{', '.join(changed)}); pass --restart to discard them")
        else:
            tmp = ident_path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(dumps(identity))
            os.replace(tmp, ident_path)

    def path(self, key: str) -> str:
        """The file holding the results of ``key`` (``layer_<i>`` or ``tail``)."""
        return os.path.join(self.dir, f"{key}.safetensors")

    def has(self, key: str) -> bool:
        """Whether the results of ``key`` were saved by an earlier run."""
        return os.path.isfile(self.path(key))

    def save(self, key: str, qws: dict[str, dict[int, QuantizedWeight]], raw: dict[str, torch.Tensor],
             stats: list[LinearStats]) -> None:
        """Write one finished layer: every candidate K of its quantized Linears, its other tensors and its stats."""
        tensors: dict = {f"{name}@k{k}": qw for name, by_k in qws.items() for k, qw in by_k.items()}
        tensors.update(raw)
        save_file(tensors, self.path(key), metadata={STATS_KEY: dumps([s.to_json() for s in stats])})

    def load(self, key: str, device: torch.device | str = "cpu"
             ) -> tuple[dict[str, dict[int, QuantizedWeight]], dict[str, torch.Tensor], list[LinearStats]]:
        """What ``save`` wrote for ``key``, on ``device``: (quantized Linears by name and K, other tensors, stats)."""
        path = self.path(key)
        with safe_open(path, framework="pt") as f:
            meta = (f.metadata() or {}).get(STATS_KEY)
        if meta is None:
            raise ModelError(f"{path} has no statistics; delete it to recompute that layer")
        stats = [LinearStats.from_json(d) for d in json.loads(meta)]
        qws: dict[str, dict[int, QuantizedWeight]] = {}
        raw: dict[str, torch.Tensor] = {}
        for name, value in load_file(path, device).items():
            if isinstance(value, QuantizedWeight):
                base, _, k = name.rpartition("@k")
                qws.setdefault(base, {})[int(k)] = value
            else:
                raw[name] = value
        return qws, raw, stats

    def remove(self) -> None:
        """Delete the partial results, run identity included (once the output is written)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def discard_partial(out_dir: str) -> None:
    """Delete OUT_DIR/.partial (``--restart``)."""
    shutil.rmtree(os.path.join(out_dir, PARTIAL_DIR), ignore_errors=True)
