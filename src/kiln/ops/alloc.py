"""Output allocation that the verifier can poison.

Kernels allocate their outputs with `empty` / `empty_like` from here instead of `torch.empty`.
Inside `poisoned()` (the verifier turns it on) those buffers come back filled with NaN (or an
integer sentinel), as does what the native CPU kernels allocate, so an element a kernel forgets to
write shows up as a failure instead of passing by luck with whatever memory held before.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence

import torch

_state = threading.local()


def poisoning() -> bool:
    return getattr(_state, "poison", False)


@contextlib.contextmanager
def poisoned(enabled: bool = True) -> Iterator[None]:
    """Within this block, `empty` and `empty_like` return poisoned memory, and so does memory ATen
    allocates itself (`at::empty` in Kiln's native C++ kernels, a plain `torch.empty`): PyTorch fills
    uninitialized memory with NaN (integers: their maximum) in its deterministic mode, turned on here
    (warnings only) for the block."""
    previous = poisoning()
    _state.poison = enabled
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        with warnings.catch_warnings():
            if enabled and not deterministic:
                warnings.filterwarnings("ignore", message=".*deterministic.*")
                torch.use_deterministic_algorithms(True, warn_only=True)
                torch.utils.deterministic.fill_uninitialized_memory = True
            yield
    finally:
        _state.poison = previous
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def poison_(tensor: torch.Tensor) -> torch.Tensor:
    """Fill `tensor` in place with NaN (floating point) or the dtype's minimum (integers)."""
    if tensor.dtype.is_floating_point:
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            tensor.view(torch.uint8).fill_(0x7F)  # a NaN bit pattern in both fp8 formats
        else:
            tensor.fill_(float("nan"))
    elif tensor.dtype == torch.bool:
        tensor.fill_(True)
    else:
        tensor.fill_(torch.iinfo(tensor.dtype).min)
    return tensor


def empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    return poison_(out) if poisoning() else out


def empty_like(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return empty(tensor.shape, dtype or tensor.dtype, tensor.device)
