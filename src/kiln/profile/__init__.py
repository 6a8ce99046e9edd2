"""Profiling (`kiln profile`): torch.profiler per-kernel tables, roofline per op, utilization gaps.

`kiln.profile.range("name")` marks a region (an engine phase) in profiles; a no-op when nobody profiles.
"""

from kiln.profile.ranges import range, session

__all__ = ["range", "session"]
