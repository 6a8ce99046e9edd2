"""Autotuning (`kiln tune`) and the persistent per-device config cache kernels read at run time."""

from kiln.tune.cache import lookup, store

__all__ = ["lookup", "store"]
