"""float64 -> float16 / bfloat16 rounded once, the same on every CPU.

PyTorch's CPU cast from float64 to a 16-bit float goes through float32 on some builds and CPUs (seen on
an AVX2-only AMD EPYC): a value just below a 16-bit midpoint first rounds to the midpoint in float32,
then ties to even, and can land one 16-bit ulp from the nearest (0.23779296776924158 became bfloat16
0.23828125, not 0.2373046875). Rounding to float32 *to odd* first (an inexact result keeps an odd last
bit) makes the second rounding the correct one, as float32 has more than two bits beyond either format.
"""

from __future__ import annotations

import torch


def round_from_float64(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (float64, any shape and device) rounded once to `dtype` (nearest, ties to even); float32 and
    float64 are plain casts."""
    if x.dtype != torch.float64:
        raise ValueError(f"round_from_float64: x must be float64, got {x.dtype}")
    if dtype not in (torch.float16, torch.bfloat16):
        return x.to(dtype)
    nearest = x.to(torch.float32)
    bits = nearest.view(torch.int32)
    inexact = nearest.to(torch.float64) != x
    # the float32 neighbour on x's side of `nearest`: one step of the bit pattern away from zero when |x|
    # is the larger, toward zero otherwise (x and `nearest` share their sign)
    away = (x.abs() > nearest.to(torch.float64).abs()).to(torch.int32) * 2 - 1
    to_odd = torch.where(inexact & (bits & 1 == 0), bits + away, bits)
    return to_odd.view(torch.float32).to(dtype)
