"""fp8_linear as int8_linear's Pallas Triton kernel (../int8_linear/pallas_gpu.py) with the e4m3 tiles
widened to bfloat16 in registers (exact: e4m3's 3 mantissa bits and exponent range fit bfloat16) and a
float32 accumulator; the fp8 bytes halve the HBM traffic of a bf16 weight. The scales are the same
epilogue."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR
from kiln.ops.gemm.int8_linear.pallas_gpu import scaled_gemm_gpu
from kiln.ops.gemm.int8_linear.pallas_tpu import empty_or
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.gemm.scaled_pallas_gpu import check_tiles
from kiln.ops.pallas_common import gpu_interpret


def fp8_linear_pallas_gpu(
    x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=jnp.bfloat16, *, tiles=None, interpret=None
):
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale)^T (+ bias); shapes: spec.py. `tiles` (block_m, block_n)
    overrides the default output tile."""
    interpret = gpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)
    tiles = check_tiles("fp8_linear", tiles)

    def kernel():
        return scaled_gemm_gpu(
            x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, jnp.bfloat16, tiles, interpret
        )

    return empty_or(kernel, x_fp8, w_fp8, bias, out_dtype)


FP8_LINEAR.register_jax("pallas_gpu", fp8_linear_pallas_gpu)
