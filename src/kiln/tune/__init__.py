"""Autotuning (`kiln tune`) and the persistent per-device config cache kernels read at run time."""

from kiln.ops.tuned_configs import export, lookup, store

__all__ = ["export", "lookup", "store"]
