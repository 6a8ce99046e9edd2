"""Performance tooling: timing, measured device ceilings, roofline, suites, reports (`kiln bench`)."""

from kiln.bench.ceilings import Ceilings, measure_ceilings
from kiln.bench.roofline import roofline
from kiln.bench.runner import bench
from kiln.bench.timing import Timing, time_fn

__all__ = ["Ceilings", "Timing", "bench", "measure_ceilings", "roofline", "time_fn"]
