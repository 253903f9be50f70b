"""Thread count for the CPU Viterbi: torch's threads while the machine is otherwise idle, one
thread while other processes want the cores.

A DP step is a few parallel ops of ~50 us, each ending in a barrier. When another process takes
a core, each barrier waits for a descheduled thread: on a 2-core machine beside one busy process
the DP ran 2x slower with 2 threads than with 1, and up to 10x beside busier neighbours
(docs/QUANT.md), while on an idle machine one thread loses ~40% of the 2-thread speed. Other
processes' CPU use is read from Linux's /proc/stat (all busy time, including time the hypervisor
gave to other guests) minus this process's own CPU time, over windows of a few hundred ms.
"""
from __future__ import annotations

import os
import time
from collections import Counter
from typing import Callable

import torch

# Use every thread only while other processes use less than this many cores in total.
OTHERS_IDLE_CORES = 0.25
# Shortest measuring window: /proc/stat counts in 10 ms ticks per core.
WINDOW_S = 0.3

Sample = tuple[float, float, float]  # (wall s, machine busy CPU s, own CPU s)


def choose_threads(max_threads: int, cores: int, others_cores: float) -> int:
    """Threads to use when other processes keep ``others_cores`` cores busy on average."""
    if max_threads <= 1:
        return 1
    free = cores - others_cores
    return max(1, min(max_threads, int(free + OTHERS_IDLE_CORES)))


def read_sample() -> Sample | None:
    """(wall, machine busy, own CPU) now, in seconds; None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        with open("/proc/self/stat", "rb") as f:
            own = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    # cpu user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait.
    ticks = [int(v) for v in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]
    # /proc/self/stat after the command name: utime and stime are fields 12 and 13 (0-based 11, 12).
    own_ticks = int(own[11]) + int(own[12])
    return time.monotonic(), busy / hz, own_ticks / hz


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class ThreadGovernor:
    """Sets torch's thread count before each block of DP work, from other processes' measured
    CPU use. Starts with one thread (safe on a busy machine) and moves to all of torch's threads
    once a window shows the other cores idle; ``restore`` puts the caller's setting back."""

    def __init__(self, max_threads: int | None = None, cores: int | None = None,
                 sample: Callable[[], Sample | None] = read_sample) -> None:
        self.max_threads = max_threads or torch.get_num_threads()
        self.cores = cores or _usable_cores()
        self._sample = sample
        self._start = sample() if self.max_threads > 1 else None
        # Without /proc/stat there is nothing to measure: behave like any torch op.
        self.threads = 1 if self._start is not None else self.max_threads
        self._saved = torch.get_num_threads()
        self.blocks: Counter[int] = Counter()  # blocks run at each thread count, for reports

    @classmethod
    def fixed(cls, threads: int) -> "ThreadGovernor":
        """A governor that always uses ``threads`` threads (no measuring)."""
        return cls(max_threads=threads, sample=lambda: None)

    def before_block(self) -> int:
        """Thread count for the next block (applied to torch); re-decided once per window."""
        if self._start is not None:
            now = self._sample()
            if now is not None and now[0] - self._start[0] >= WINDOW_S:
                wall = now[0] - self._start[0]
                others = max(0.0, (now[1] - self._start[1]) - (now[2] - self._start[2])) / wall
                self.threads = choose_threads(self.max_threads, self.cores, others)
                self._start = now
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        self.blocks[self.threads] += 1
        return self.threads

    def restore(self) -> None:
        """Give torch back the thread count it had when the governor was made."""
        if torch.get_num_threads() != self._saved:
            torch.set_num_threads(self._saved)
