"""CPU linear layers on oneDNN with the weight reordered once at load time.

PyTorch's default CPU GEMM for `F.linear` (MKL sgemm) is slow on the skinny inputs of decode: on the
2-core AVX-512 machine this project measures on, 3072x576 at 16 rows takes 0.43 ms through MKL and
0.13 ms through oneDNN with a pre-reordered weight (the LM head 49152x576: 13.2 ms vs 3.1 ms), with
the same float32 arithmetic (relative error ~4e-7 against float64 either way). These are the ops
PyTorch's inductor uses for frozen CPU linears (`torch.ops.mkldnn._reorder_linear_weight` /
`_linear_pointwise`); when the build lacks them, `pack` returns None and callers use F.linear.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN and its prepacked-linear ops."""
    try:
        ops = torch.ops.mkldnn
        return torch.backends.mkldnn.is_available() and all(
            hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] float32/bfloat16 on the CPU -> oneDNN's blocked copy of it (an opaque tensor
    only `linear` can read), or None when oneDNN is not available or cannot pack this weight here."""
    if not available() or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.dim() != 2 or 0 in weight.shape:
        return None
    try:  # bf16 needs avx512bw/vl/dq or avx_ne_convert; the op raises on other CPUs
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:
        return None


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y [M, out] = x [M, in] @ W^T + bias with W as returned by `pack`; x has the packed weight's
    dtype, bias [out] too (or None)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
