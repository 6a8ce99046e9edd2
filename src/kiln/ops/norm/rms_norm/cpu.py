"""Fast CPU RMSNorm: float32 tensors through Kiln's native kernel (rms_norm_cpu.cpp, one call; eager
only), others through PyTorch's CPU operator, statistics in float32; a weight offset (Gemma's
1 + weight) is added to a float32 copy of the weight."""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.norm.rms_norm.spec import RMS_NORM
from kiln.ops.registry import Implementation, cpu_only


def _native(x, weight, residual) -> bool:
    """Whether the native kernel takes this call: eager (a compiled graph traces the tensor form),
    float32 x and weight, a contiguous residual (written in place), the library built."""
    return (
        not torch.compiler.is_compiling()
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and (residual is None or residual.is_contiguous())
        and native_cpu.load()
    )


def rms_norm_cpu(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    if _native(x, weight, residual):
        out = torch.ops.kiln_cpu.rms_norm(x, weight, eps, residual, weight_offset)
        return out if residual is None else (out, residual)
    if residual is not None:
        residual.add_(x)
        x = residual
    if weight_offset != 0.0:
        weight = weight.float() + weight_offset
    if x.dtype == torch.float32:
        out = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        out = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return out if residual is None else (out, residual)


RMS_NORM.register(Implementation("cpu", rms_norm_cpu, cpu_only))
