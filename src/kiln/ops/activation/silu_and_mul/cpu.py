"""Fast CPU silu_and_mul: float32 through Kiln's native kernel (silu_and_mul_cpu.cpp, one pass; eager only),
others through PyTorch's vectorized CPU silu and an in-place multiply, in float32 for halves so the
result is rounded once (silu rounded to bf16 before the multiply errs by up to two roundings)."""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL
from kiln.ops.registry import Implementation, cpu_only


def silu_and_mul_cpu(x):
    if not torch.compiler.is_compiling() and x.dtype == torch.float32 and native_cpu.load():
        return torch.ops.kiln_cpu.silu_and_mul(x)
    d = x.shape[-1] // 2
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.nn.functional.silu(x[..., :d].float()).mul_(x[..., d:]).to(x.dtype)
    return torch.nn.functional.silu(x[..., :d]).mul_(x[..., d:])


SILU_AND_MUL.register(Implementation("cpu", silu_and_mul_cpu, cpu_only))
