"""paged_decode_attention: spec (signature, reference, shapes) in spec.py, one file per backend beside it
(pallas_tpu.py and xla.py register themselves when jax is installed, see kiln.ops.jax_bridge)."""

from kiln.ops.attention.paged_decode_attention import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION, paged_decode_attention

__all__ = ["PAGED_DECODE_ATTENTION", "paged_decode_attention"]
