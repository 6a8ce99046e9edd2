"""Mixture-of-experts ops: routing (route_spec.py), token alignment (align.py) and the fused expert
MLP (spec.py); Triton kernels in triton.py / triton_route.py, fast CPU paths in cpu.py."""

from kiln.ops.moe import cpu, triton, triton_route  # noqa: F401  (registers the implementations)
from kiln.ops.moe.align import moe_align_block_size
from kiln.ops.moe.route_spec import moe_route
from kiln.ops.moe.spec import fused_moe, quantize_experts_fp8

__all__ = ["fused_moe", "moe_align_block_size", "moe_route", "quantize_experts_fp8"]
