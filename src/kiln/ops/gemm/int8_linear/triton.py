"""Triton int8_linear: the scaled GEMM of ../scaled_triton.py on int8 operands (int8 tl.dot, int32
accumulators, the x_scale[m] * w_scale[n] epilogue in float32, split-K for small M)."""

from __future__ import annotations

import torch

from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR
from kiln.ops.gemm.scaled_triton import scaled_linear, scaled_linear_configs
from kiln.ops.registry import Implementation, triton_available


def int8_linear_triton(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16, config=None):
    return scaled_linear("int8_linear", x_int8, x_scale, w_int8, w_scale, bias, out_dtype, config)


INT8_LINEAR.register(
    Implementation(
        "triton",
        int8_linear_triton,
        triton_available,
        configs=scaled_linear_configs,
        description="int8 tl.dot, int32 accumulation, scale epilogue, split-K",
    )
)
