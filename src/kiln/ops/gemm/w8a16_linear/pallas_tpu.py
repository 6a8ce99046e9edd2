"""w8a16_linear as linear's Mosaic TPU kernel (../linear/pallas_tpu.py) with the per-channel scale
epilogue: int8 weight tiles cross HBM at one byte per weight and are widened to x's dtype in VMEM."""

from __future__ import annotations

from kiln.ops.gemm.linear.pallas_tpu import gemm_tpu
from kiln.ops.gemm.linear.xla import over_rows
from kiln.ops.gemm.w8a16_linear.spec import W8A16_LINEAR
from kiln.ops.gemm.w8a16_linear.xla import flat_scale
from kiln.ops.pallas_common import tpu_interpret


def w8a16_linear_pallas_tpu(x, weight, weight_scale, bias=None, *, blocks=None, interpret=None):
    """(x [..., K] @ weight int8 [N, K]^T) * weight_scale (+ bias); the Mosaic TPU kernel (interpreted
    off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    scale = flat_scale(weight_scale)

    def kernel(x2):
        return gemm_tpu(x2, weight, scale, bias, silu_mul=False, blocks=blocks, interpret=interpret)

    return over_rows(kernel, x, weight.shape[0], bias)


W8A16_LINEAR.register_jax("pallas_tpu", w8a16_linear_pallas_tpu)
