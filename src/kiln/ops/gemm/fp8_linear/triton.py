"""Triton fp8_linear: the scaled GEMM of ../scaled_triton.py on e4m3 operands (fp8 tl.dot, float32
accumulators, the x_scale[m] * w_scale[n] epilogue, split-K for small M)."""

from __future__ import annotations

import torch

from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR
from kiln.ops.gemm.scaled_triton import scaled_linear, scaled_linear_configs
from kiln.ops.registry import Implementation, triton_available


def fp8_linear_triton(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16, config=None):
    return scaled_linear("fp8_linear", x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype, config)


FP8_LINEAR.register(
    Implementation(
        "triton",
        fp8_linear_triton,
        triton_available,
        configs=scaled_linear_configs,
        description="fp8 tl.dot, fp32 accumulation, scale epilogue, split-K",
    )
)
