"""Progress bars (tqdm) on stderr, shown when someone is watching, and the slow-work notice."""
from __future__ import annotations

import os
import sys
from typing import Callable

from tqdm import tqdm

# A called-back progress: progress(done, total), in the caller's units (tiles for the encoder).
ProgressFn = Callable[[int, int], None]


class SlowWorkWarning(UserWarning):
    """Work estimated to take long on the chosen device (a GPU would be much faster)."""


def wanted(progress: bool | None) -> bool:
    """Whether to draw: ``progress`` if given, else only when stderr is a terminal."""
    if progress is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


def bar(total: float | None, desc: str, progress: bool | None = None, unit: str = "it", **kwargs) -> tqdm:
    """A tqdm bar on stderr; disabled (a no-op with the same methods) unless ``wanted(progress)``.

    Off a terminal (``progress=True`` with stderr redirected) it redraws at most every 5 s, so
    that logs stay short.
    """
    tty = bool(getattr(sys.stderr, "isatty", lambda: False)())
    # A terminal that reports no size (some pseudo-terminals) would hide the bar: 100 x 24 then.
    width = {} if not tty else {"dynamic_ncols": True} if _columns() > 0 else {"ncols": 100, "nrows": 24}
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=not wanted(progress),
                mininterval=0.1 if tty else 5.0, **width, **kwargs)


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return 0


def format_seconds(s: float) -> str:
    """A duration for people: "45 s", "12 min", "3.4 h"."""
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def format_bytes(n: int) -> str:
    """A size for people, in powers of 1000 as file managers show it: "482.31 kB", "1.72 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
