"""Mixture-of-experts ops, one folder each: moe_route (gate scores, top-k experts per token) and
fused_moe (the experts' SwiGLU MLPs as grouped GEMMs). align.py holds what fused_moe's Triton
kernels need first: the token-expert pairs grouped by expert, padded to the GEMM's BLOCK_M."""

from kiln.ops.moe.align import moe_align_block_size
from kiln.ops.moe.fused_moe import fused_moe, quantize_experts_fp8
from kiln.ops.moe.moe_route import moe_route

__all__ = ["fused_moe", "moe_align_block_size", "moe_route", "quantize_experts_fp8"]
