"""`realized`: a value a compiled graph computes once into a buffer, for code traced into one.

Inductor inlines a pointwise producer into each of its consumers. Where the consumer is a loop that
reads its input many times (a GEMV over every output row, attention scores over every key), the
producer (an RMSNorm, RoPE) is then recomputed each time. ATen fallbacks take buffers as inputs, so
passing x through one forces it out. view_as_complex and back is the cheapest found: two views that
the C++ wrapper calls through PyTorch's C shims, ~1 us (a Python custom op making a copy cost ~16 us
a call there; a matmul by the identity ~6 us).
"""

from __future__ import annotations

import warnings

import torch

# Lowering the pair, inductor warns once per graph that it generates no code for complex operators;
# here that is the point, not a performance problem.
warnings.filterwarnings(
    "ignore", message="Torchinductor does not support code generation for complex operators"
)


def realized(x: torch.Tensor) -> torch.Tensor:
    """x float32 / float64, any shape -> x, computed into a buffer of its own when traced.

    Eager calls, and other dtypes or an odd number of elements (no complex view of those), return x
    itself: the same values, only without the barrier."""
    if not torch.compiler.is_compiling() or x.dtype not in (torch.float32, torch.float64) or x.numel() % 2:
        return x
    pairs = x.reshape(x.numel() // 2, 2)
    return torch.view_as_real(torch.view_as_complex(pairs)).reshape(x.shape)
