"""CPU int8_linear: a float32 matmul of the raw int8 values (exact below 2^24), the scales on the
result."""

from __future__ import annotations

import torch

from kiln.ops.gemm.int8_linear.spec import INT8_LINEAR
from kiln.ops.gemm.scaled import scaled_linear_cpu
from kiln.ops.registry import Implementation, cpu_only


def int8_linear_cpu(x_int8, x_scale, w_int8, w_scale, bias=None, out_dtype=torch.bfloat16):
    return scaled_linear_cpu(x_int8, x_scale, w_int8, w_scale, bias, out_dtype)


INT8_LINEAR.register(Implementation("cpu", int8_linear_cpu, cpu_only))
