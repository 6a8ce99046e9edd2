"""fp8_linear as int8_linear's Mosaic TPU kernel (../int8_linear/pallas_tpu.py) with the e4m3 tiles
widened to bfloat16 in VMEM (exact) and a float32 accumulator: the TPU MXUs before v7 have no fp8
inputs, so the fp8 bytes only save HBM traffic; the scales are the same epilogue."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR
from kiln.ops.gemm.int8_linear.pallas_tpu import empty_or, scaled_gemm_tpu
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.pallas_common import tpu_interpret


def fp8_linear_pallas_tpu(
    x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=jnp.bfloat16, *, blocks=None, interpret=None
):
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T (+ bias); shapes: spec.py."""
    interpret = tpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)

    def kernel():
        return scaled_gemm_tpu(
            x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, jnp.bfloat16, blocks, interpret
        )

    return empty_or(kernel, x_fp8, w_fp8, bias, out_dtype)


FP8_LINEAR.register_jax("pallas_tpu", fp8_linear_pallas_tpu)
