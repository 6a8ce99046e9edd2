"""Helpers that make inputs for op specs: fresh random data on a generator, never zeros."""

from __future__ import annotations

import torch


def randn(shape, dtype: torch.dtype, device, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values (times `scale`) drawn in float32 on the CPU, then cast and moved."""
    values = torch.randn(tuple(shape), generator=generator, dtype=torch.float32) * scale
    return values.to(dtype=dtype, device=device)


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
