"""The "torch_bf16_matmul" baseline of the quantized GEMMs: what the same layer costs as a plain bf16
GEMM (cuBLAS on CUDA) on the dequantized weight. `kiln bench` reports each quantized kernel's speed-up
over it in the same run, which is the question a user of a quantized checkpoint asks.

The dense bf16 weight is made once per quantized weight tensor (outside the timed calls) and dropped
when that tensor is freed; the timed call converts x to bf16 and runs F.linear.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

_DENSE: dict[int, torch.Tensor] = {}


def _dense_for(key: torch.Tensor, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """make() -> float [N, K], cached in bf16 while `key` lives."""
    ident = id(key)
    if ident not in _DENSE:
        _DENSE[ident] = make().to(torch.bfloat16).contiguous()
        weakref.finalize(key, _DENSE.pop, ident, None)
    return _DENSE[ident]


def bf16_matmul(
    x: torch.Tensor, key: torch.Tensor, make: Callable[[], torch.Tensor], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (any float dtype) -> bf16 [M, N] = x @ W^T + bias, W = make() (the dequantized weight,
    cached per `key`, the quantized weight tensor)."""
    weight = _dense_for(key, make)
    return F.linear(x.to(torch.bfloat16), weight, None if bias is None else bias.to(torch.bfloat16))
