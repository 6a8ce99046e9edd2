"""fused_moe: spec (signature, reference, shapes) in spec.py, one file per backend beside it; the
token-expert alignment its Triton kernels need is the family's align.py."""

from kiln.ops.moe.fused_moe import cpu, triton  # noqa: F401  (register the implementations)
from kiln.ops.moe.fused_moe.spec import FUSED_MOE, fused_moe, quantize_experts_fp8

__all__ = ["FUSED_MOE", "fused_moe", "quantize_experts_fp8"]
