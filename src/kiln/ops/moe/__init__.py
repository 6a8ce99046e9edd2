"""Mixture-of-experts ops: routing (route_spec.py), token alignment (align.py) and the fused expert
MLP (spec.py); Triton kernels in triton.py / triton_route.py / triton_align.py, fast CPU paths in
cpu.py, `torch.ops.kiln.*` registrations in library.py."""

from kiln.ops.moe import cpu, library, triton, triton_route  # noqa: F401  (registers implementations, torch ops)
from kiln.ops.moe.align import moe_align_block_size
from kiln.ops.moe.route_spec import moe_route
from kiln.ops.moe.spec import fused_moe, quantize_experts_fp8

__all__ = ["fused_moe", "moe_align_block_size", "moe_route", "quantize_experts_fp8"]
