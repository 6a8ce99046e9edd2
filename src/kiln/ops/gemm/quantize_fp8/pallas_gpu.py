"""quantize_fp8 as quantize_int8's row-wise Pallas Triton kernel (../quantize_int8/pallas_gpu.py) with
e4m3 output (round to nearest even in the cast). Per tensor: the kernel's per-row scales give the row
amaxes, XLA takes their max, and a second pass of the kernel quantizes with that one scale."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.gemm.quantize_fp8.spec import QUANTIZE_FP8
from kiln.ops.gemm.quantize_int8.pallas_gpu import quantize_rows_gpu
from kiln.ops.gemm.scaled import FP8_MAX
from kiln.ops.pallas_common import gpu_interpret


def quantize_fp8_pallas_gpu(x, per_token=True, *, interpret=None):
    """x [M, K] -> (x_fp8 [M, K] e4m3, scale float32 [M, 1] or [1]); shapes: spec.py."""
    interpret = gpu_interpret() if interpret is None else interpret
    q, scale = quantize_rows_gpu(x, None, FP8_MAX, jnp.float8_e4m3fn, False, interpret)
    if per_token:
        return q, scale
    tensor_scale = jnp.max(scale).reshape(1)  # max over rows of max(amax_row, floor) / 448
    q, _ = quantize_rows_gpu(x, tensor_scale, FP8_MAX, jnp.float8_e4m3fn, False, interpret)
    return q, tensor_scale


QUANTIZE_FP8.register_jax("pallas_gpu", quantize_fp8_pallas_gpu)
