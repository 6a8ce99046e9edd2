"""CPU fp8_block_linear: x quantized per token and group in float32 (as the reference), the weight
dequantized to float32, one float32 GEMM. The engine does not call this on the CPU (the loader
dequantizes block-FP8 weights once); it is the op's CPU path for `kiln verify` and for tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR, block_scales, quantize_groups_reference
from kiln.ops.registry import Implementation, cpu_only


def fp8_block_linear_cpu(x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=torch.bfloat16):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    N, K = w_fp8.shape
    w = w_fp8.to(compute) * block_scales(w_scale.to(compute), N, K, block_n, block_k)
    y = F.linear(quantize_groups_reference(x, block_k), w, None if bias is None else bias.to(compute))
    return y.to(out_dtype)


FP8_BLOCK_LINEAR.register(Implementation("cpu", fp8_block_linear_cpu, cpu_only))
