"""CUDA side of the method: graph-captured rotations timed with events, copy bandwidth, device facts."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .roofline import DeviceInfo

# Fallback SM clock when torch does not expose clock_rate: the H200's boost clock.
FALLBACK_CLOCK_HZ = 1.98e9
COPY_BYTES = 1 << 30  # per buffer; far beyond any L2, so the copy streams from HBM
COPY_CALLS = 4  # copies per captured graph
COPY_REPLAYS = 5


class GraphSampler:
    """Replays one captured graph (one call per rotation buffer) between CUDA events."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", n_calls: int, replays: int, keep: Any) -> None:
        self.graph, self.n_calls, self.replays = graph, n_calls, replays
        self._keep = keep  # outputs allocated in the graph's pool stay valid while it lives

    def sample(self) -> float:
        """One untimed replay, then ``replays`` timed ones: microseconds per call."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self.graph.replay()  # untimed: settles clocks after the previous arm
        start.record()
        for _ in range(self.replays):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (self.replays * self.n_calls)


@dataclass
class GraphTimer:
    """Builds GraphSamplers: warm up every buffer once on a side stream (compiles, autotunes,
    allocates workspaces), then capture one graph that calls the arm once per buffer."""

    replays: int = 3

    def build(self, fn: Callable[[int], Any], n_buffers: int, label: str) -> GraphSampler:
        """Warm ``fn`` up on every buffer, capture one graph calling it once per buffer, and sample that."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(n_buffers):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            first = fn(0)
            for i in range(1, n_buffers):
                fn(i)  # dropped at once: the pool reuses its memory for the next call
        torch.cuda.synchronize()
        return GraphSampler(graph, n_buffers, self.replays, first)


def measure_copy_bandwidth(nbytes: int = COPY_BYTES, calls: int = COPY_CALLS,
                           replays: int = COPY_REPLAYS) -> float:
    """Device-to-device copy inside a CUDA graph: (bytes read + bytes written) / second, best replay."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            dst.copy_(src)
    graph.replay()
    best = float("inf")
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e-3)
    del graph, src, dst
    torch.cuda.empty_cache()
    return 2.0 * nbytes * calls / best


def driver_version() -> str:
    """The NVIDIA driver version from nvidia-smi, or "unknown"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info(copy_bw: float | None = None) -> DeviceInfo:
    """Facts about cuda:0; measures copy bandwidth unless given."""
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "clock_rate", 0) or 0  # cudaDeviceProp.clockRate is in kHz
    clock_hz = clock_khz * 1e3 if clock_khz else FALLBACK_CLOCK_HZ
    bw = measure_copy_bandwidth() if copy_bw is None else copy_bw
    return DeviceInfo(name=props.name, sms=props.multi_processor_count, l2_bytes=int(props.L2_cache_size),
                      clock_hz=clock_hz, copy_bw=bw, driver=driver_version())
