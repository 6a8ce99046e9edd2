"""qk_norm_rope: spec (signature, reference, shapes) in spec.py, one file per backend beside it
(no JAX backends yet)."""

from kiln.ops.rope.qk_norm_rope import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE, qk_norm_rope

__all__ = ["QK_NORM_ROPE", "qk_norm_rope"]
