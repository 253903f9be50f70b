"""Choosing and checking the torch device a command or function runs on."""
from __future__ import annotations

import torch
from torch import nn

#: Device types escha computes on: the CPU (reference codec, CPU encoder) and CUDA GPUs (Triton).
DEVICE_TYPES = ("cpu", "cuda")


class DeviceError(ValueError):
    """A device that does not exist or that this torch cannot use; the message is one line."""


def default_device() -> str:
    """"cuda" when torch sees a CUDA GPU, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (the CPU for an empty module)."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def resolve_device(device: str | torch.device | None = None, what: str = "device") -> torch.device:
    """The torch device for ``device``; None or "auto" picks ``default_device()``.

    Raises DeviceError naming ``what`` (e.g. "--device") for a name that is not a device, a
    type escha does not run on, CUDA with a torch built without it or with no GPU visible, and
    a GPU index beyond those visible.
    """
    if device is None or (isinstance(device, str) and device.strip().lower() == "auto"):
        return torch.device(default_device())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise DeviceError(f"{what} {str(device)!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in DEVICE_TYPES:
        raise DeviceError(f"{what} {dev}: escha runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise DeviceError(f"{what} {dev}: this torch ({torch.__version__}) was built without CUDA; "
                              f"install a CUDA build of torch or use cpu")
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceError(f"{what} {dev}: torch sees no CUDA GPU")
        if dev.index is not None and dev.index >= count:
            raise DeviceError(f"{what} {dev}: only {count} CUDA GPU(s) visible (cuda:0..cuda:{count - 1})")
    return dev
