"""Roofline columns: bytes moved, the memory floor, escha's integer codec floor, TFLOP/s."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Integer ops (shift, and, mad, lop3, prmt) issue at 64 lanes per clock per SM on Hopper.
INT_LANES_PER_SM = 64


@dataclass(frozen=True)
class DeviceInfo:
    """What the roofline and the rotation need to know about the GPU.

    Attributes:
        name: device name.   sms: streaming multiprocessors.   l2_bytes: L2 cache size.
        clock_hz: SM clock.  copy_bw: measured device-to-device copy bandwidth, bytes read
        plus written per second (NaN when not measured).   driver: driver version string.
    """

    name: str
    sms: int
    l2_bytes: int
    clock_hz: float
    copy_bw: float
    driver: str = "unknown"


def bytes_moved(N: int, K: int, M: int, weight_bits: float, act_bytes: int, out_bytes: int) -> float:
    """Weights once, activations once, output once: the traffic no kernel can avoid."""
    return N * K * weight_bits / 8 + M * K * act_bytes + M * N * out_bytes


def memory_floor_us(nbytes: float, copy_bw: float) -> float:
    """Time to move ``nbytes`` at the measured copy bandwidth (NaN if unmeasured)."""
    if not copy_bw or not math.isfinite(copy_bw):
        return float("nan")
    return nbytes / copy_bw * 1e6


def codec_floor_us(N: int, K: int, int_ops_per_weight: float, sms: int, clock_hz: float) -> float:
    """Time to issue the codec's integer ops for every weight once: N*K*ops / (64 * SMs * clock)."""
    return N * K * int_ops_per_weight / (INT_LANES_PER_SM * sms * clock_hz) * 1e6


def tflops(N: int, K: int, M: int, us: float) -> float:
    """Achieved TFLOP/s at 2*M*N*K flops (NaN when there is no time)."""
    if not us or not math.isfinite(us):
        return float("nan")
    return 2.0 * M * N * K / (us * 1e-6) / 1e12
