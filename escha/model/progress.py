"""A small dependency-free progress printer for stderr, with rate and ETA."""
from __future__ import annotations

import sys
import time
from typing import TextIO


def format_seconds(s: float) -> str:
    """Seconds as H:MM:SS or M:SS."""
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Prints ``desc [#####.....] n/total pct elapsed ETA`` to a stream.

    On a terminal the line is redrawn in place; otherwise (logs, CI) a new line is written at
    most every ``interval`` seconds and at the end, so logs stay short.
    """

    def __init__(self, total: int, desc: str = "", stream: TextIO | None = None,
                 enabled: bool = True, interval: float = 2.0, width: int = 24) -> None:
        self.total = max(0, int(total))
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.interval = interval
        self.width = width
        self.n = 0
        self.skipped = 0
        self.note = ""
        self.start = time.perf_counter()
        self._last = 0.0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1, note: str | None = None, skipped: bool = False) -> None:
        """Advance by ``n`` steps; ``skipped`` steps (resumed work) do not count toward the rate."""
        self.n = min(self.total, self.n + n) if self.total else self.n + n
        if skipped:
            self.skipped += n
        if note is not None:
            self.note = note
        self._draw(final=self.n >= self.total)

    def line(self) -> str:
        """The current status line."""
        elapsed = time.perf_counter() - self.start
        done = self.n / self.total if self.total else 1.0
        bar = "#" * int(done * self.width)
        worked = self.n - self.skipped
        left = self.total - self.n
        eta = "?" if worked <= 0 else format_seconds(elapsed / worked * left)
        text = (f"{self.desc} [{bar:<{self.width}}] {self.n}/{self.total} {100 * done:5.1f}% "
                f"elapsed {format_seconds(elapsed)} ETA {eta}")
        return f"{text} {self.note}".rstrip()

    def _draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not final and now - self._last < (0.1 if self._tty else self.interval):
            return
        self._last = now
        if self._tty:
            self.stream.write("\r\x1b[K" + self.line() + ("\n" if final else ""))
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final line if the bar did not reach its total."""
        if self.enabled and self.n < self.total:
            self.enabled and self.stream.write(("\r\x1b[K" if self._tty else "") + self.line() + "\n")
            self.stream.flush()
