"""Roofline arithmetic: what the hardware allows for a given amount of work and traffic.

bound (s)    = max(flops / peak_flops, bytes / peak_bandwidth)  (the slower of the two ceilings)
fraction     = bound / measured                                 (1.0 = at the roofline)
intensity    = flops / bytes                                    (FLOP per byte)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class RooflinePoint:
    """All times in seconds, rates per second (not scaled)."""

    flops: float
    bytes: float
    seconds: float
    intensity: float
    flops_per_s: float
    bytes_per_s: float
    bound_s: float
    fraction: float
    limiter: str  # "memory" or "compute": which ceiling sets the bound


def roofline(
    flops: float, bytes_moved: float, seconds: float, peak_flops: float, peak_bandwidth: float
) -> RooflinePoint:
    """Place one measured case on the roofline (see the module docstring)."""
    if seconds <= 0 or peak_flops <= 0 or peak_bandwidth <= 0:
        raise ValueError(
            f"roofline: time and ceilings must be positive (seconds={seconds}, "
            f"peak_flops={peak_flops}, peak_bandwidth={peak_bandwidth})"
        )
    compute_s = flops / peak_flops
    memory_s = bytes_moved / peak_bandwidth
    bound = max(compute_s, memory_s)
    return RooflinePoint(
        flops=flops,
        bytes=bytes_moved,
        seconds=seconds,
        intensity=flops / bytes_moved if bytes_moved > 0 else math.inf,
        flops_per_s=flops / seconds,
        bytes_per_s=bytes_moved / seconds,
        bound_s=bound,
        fraction=bound / seconds,
        limiter="compute" if compute_s >= memory_s else "memory",
    )


def ridge_point(peak_flops: float, peak_bandwidth: float) -> float:
    """The arithmetic intensity (FLOP/byte) where the two ceilings meet."""
    return peak_flops / peak_bandwidth
