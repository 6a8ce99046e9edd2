"""Rotary position embedding: the cos/sin cache (cache.py, a plain helper built once per model), the
in-place rotation op (rotary_embedding/: spec + one file per backend) and the rotation fused with a
per-head RMSNorm of q and k (qk_norm_rope/, Qwen3)."""

from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.rope.qk_norm_rope import qk_norm_rope
from kiln.ops.rope.rotary_embedding import rotary_embedding

__all__ = ["qk_norm_rope", "rope_cos_sin_cache", "rotary_embedding"]
