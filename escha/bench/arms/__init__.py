"""The arm registry: names accepted by ``escha bench --arms``."""
from __future__ import annotations

from typing import Callable

from .base import Arm, ArmMeta, DEFAULT_TOLERANCE
from .escha_arms import PREFIX as ESCHA_PREFIX, WILDCARD as ESCHA_WILDCARD, EschaArm
from .gemlite_arms import GemliteInt, GemliteMxfp4
from .mxfp4 import TritonMxfp4
from .torch_arms import TorchBf16, TorchFp8

__all__ = ["Arm", "ArmMeta", "DEFAULT_TOLERANCE", "REGISTRY", "DEFAULT_ARMS", "make_arm", "parse_arms"]

REGISTRY: dict[str, Callable[[], Arm]] = {
    "escha": lambda: EschaArm(None),
    "torch-bf16": TorchBf16,
    "torch-fp8": TorchFp8,
    "triton-mxfp4": TritonMxfp4,
    "gemlite-w4": lambda: GemliteInt(4),
    "gemlite-w2": lambda: GemliteInt(2),
    "gemlite-mxfp4": GemliteMxfp4,
}
ESCHA_ALL = f"{ESCHA_PREFIX}-{ESCHA_WILDCARD}"
DEFAULT_ARMS: tuple[str, ...] = ("escha", ESCHA_ALL, "torch-bf16", "torch-fp8", "triton-mxfp4",
                                 "gemlite-w4", "gemlite-w2", "gemlite-mxfp4")


def make_arm(name: str) -> Arm:
    """Build the arm called ``name``: a registry name, ``escha-<path>`` or ``escha-*`` (every path)."""
    if name in REGISTRY:
        return REGISTRY[name]()
    prefix = ESCHA_PREFIX + "-"
    if name.startswith(prefix) and len(name) > len(prefix):
        path = name[len(prefix):]
        if path == ESCHA_WILDCARD or path.replace("_", "").replace("-", "").isalnum():
            return EschaArm(path)
    known = ", ".join([*REGISTRY, "escha-<path>", ESCHA_ALL])
    raise ValueError(f"unknown arm {name!r}: known arms are {known}")


def parse_arms(text: str) -> list[str]:
    """Comma-separated arm names, validated, duplicates dropped, order kept."""
    names: list[str] = []
    for t in text.split(","):
        t = t.strip()
        if t and t not in names:
            make_arm(t)
            names.append(t)
    if not names:
        raise ValueError("no arms given")
    return names
