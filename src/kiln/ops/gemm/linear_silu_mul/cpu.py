"""Fast CPU linear_silu_mul: one PyTorch GEMM into [..., 2N] (float32 for half-precision inputs),
SiLU-and-mul on the float32 result, rounded to x's dtype once."""

from __future__ import annotations

import torch.nn.functional as F

from kiln.ops.gemm.linear.cpu import as_compute
from kiln.ops.gemm.linear_silu_mul.spec import LINEAR_SILU_MUL
from kiln.ops.registry import Implementation, cpu_only


def linear_silu_mul_cpu(x, weight_gate_up):
    gate, up = F.linear(as_compute(x), as_compute(weight_gate_up)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


LINEAR_SILU_MUL.register(Implementation("cpu", linear_silu_mul_cpu, cpu_only))
