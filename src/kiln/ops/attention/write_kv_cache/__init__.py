"""write_kv_cache: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.attention.write_kv_cache import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE, write_kv_cache

__all__ = ["WRITE_KV_CACHE", "write_kv_cache"]
