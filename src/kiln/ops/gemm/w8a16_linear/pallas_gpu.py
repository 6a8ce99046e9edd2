"""w8a16_linear as linear's Pallas Triton kernel (../linear/pallas_gpu.py) with the per-channel scale
epilogue: int8 weight panels widened to x's dtype in registers."""

from __future__ import annotations

from kiln.ops.gemm.linear.pallas_gpu import gemm_gpu
from kiln.ops.gemm.linear.xla import over_rows
from kiln.ops.gemm.w8a16_linear.spec import W8A16_LINEAR
from kiln.ops.gemm.w8a16_linear.xla import flat_scale
from kiln.ops.pallas_common import gpu_interpret


def w8a16_linear_pallas_gpu(x, weight, weight_scale, bias=None, *, blocks=None, interpret=None):
    """(x [..., K] @ weight int8 [N, K]^T) * weight_scale (+ bias); the Pallas Triton kernel
    (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    scale = flat_scale(weight_scale)

    def kernel(x2):
        return gemm_gpu(x2, weight, scale, bias, silu_mul=False, blocks=blocks, interpret=interpret)

    return over_rows(kernel, x, weight.shape[0], bias)


W8A16_LINEAR.register_jax("pallas_gpu", w8a16_linear_pallas_gpu)
