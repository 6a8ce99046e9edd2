"""CPU fp8_linear: a float32 matmul of the raw e4m3 values (exact below 2^24), the scales on the result."""

from __future__ import annotations

import torch

from kiln.ops.gemm.fp8_linear.spec import FP8_LINEAR
from kiln.ops.gemm.scaled import scaled_linear_cpu
from kiln.ops.registry import Implementation, cpu_only


def fp8_linear_cpu(x_fp8, x_scale, w_fp8, w_scale, bias=None, out_dtype=torch.bfloat16):
    return scaled_linear_cpu(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


FP8_LINEAR.register(Implementation("cpu", fp8_linear_cpu, cpu_only))
