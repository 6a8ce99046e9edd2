"""Helpers for op specs: inputs (fresh random data on a generator, never zeros), the float64 copies
their references run on, and the error bounds shared by ops rounded once."""

from __future__ import annotations

import copy
from typing import Any

import torch

# Bounds against the float64 reference for an op whose every output is computed in float32 and rounded
# once to its dtype. One rounding errs by at most u per element (unit roundoff: 2^-11 fp16, 2^-8 bf16)
# and by ~0.45 u in relative norm (measured, all CPU paths); the norm bound is 2u, so a kernel that
# rounds an intermediate to the half, or accumulates in one, fails. float32: reductions in float32
# (a few hundred ulps over long rows).
ONE_ROUNDING_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
# pointwise_error bound for elementwise / row ops (each element one rounding; 5% for float32 math)
ONE_ROUNDING_POINTWISE = {torch.float16: 1.05, torch.bfloat16: 1.05}


def randn(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times `scale`) drawn in float32 on the CPU, then cast and moved."""
    values = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return values.to(dtype=dtype, device=device)


def fused_qkv_views(
    tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [T, Hq, D], k [T, Hk, D], v [T, Hk, D]) as views into one random [T, (Hq + 2 Hk) D] buffer,
    the way the engine splits its fused QKV projection: their token stride is the whole row, so a
    kernel that assumes contiguous heads reads (or writes) the wrong elements."""
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = randn((tokens, q_size + 2 * kv_size), dtype, device, generator)
    q = qkv[:, :q_size].view(tokens, q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(tokens, kv_heads, head_dim)
    return q, k, v


def uniform(
    shape, low: float, high: float, dtype: torch.dtype, device, generator: torch.Generator
) -> torch.Tensor:
    values = torch.rand(tuple(shape), generator=generator, dtype=torch.float32) * (high - low) + low
    return values.to(dtype=dtype, device=device)


def randint(
    shape, low: int, high: int, dtype: torch.dtype, device, generator: torch.Generator
) -> torch.Tensor:
    return torch.randint(low, high, tuple(shape), generator=generator).to(dtype=dtype, device=device)


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least float32: float64 stays float64 (the verifier's reference), halves go to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast_to_float64(value: Any) -> Any:
    """Float tensors become float64 copies; everything else is deep-copied unchanged (opaque packed
    tensors too, e.g. a oneDNN-blocked weight: only their kernel can read them)."""

    def upcast(t: torch.Tensor) -> torch.Tensor:
        if t.layout != torch.strided or not t.is_floating_point():
            return t.detach().clone()
        return t.detach().to(torch.float64)

    return _map_tensors(value, upcast, copy.deepcopy)


def clone_inputs(value: Any) -> Any:
    """An input set (or any value in one) with every tensor cloned, same strides and values in new
    memory; lists, tuples and dicts rebuilt, anything else shared."""
    return _map_tensors(value, lambda t: t.detach().clone(), lambda other: other)


def _map_tensors(value: Any, on_tensor, on_other) -> Any:
    """`value` with on_tensor applied to each tensor and on_other to each other leaf, through dicts,
    lists and tuples (rebuilt)."""
    if isinstance(value, torch.Tensor):
        return on_tensor(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, on_tensor, on_other) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, on_tensor, on_other) for v in value)
    return on_other(value)
