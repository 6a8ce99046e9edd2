"""paged_prefill_attention: spec (signature, reference, shapes) in spec.py, one file per backend beside it."""

from kiln.ops.attention.paged_prefill_attention import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION, paged_prefill_attention

__all__ = ["PAGED_PREFILL_ATTENTION", "paged_prefill_attention"]
