"""torch <-> JAX without copies: both sides speak DLPack, so a CPU torch tensor becomes a CPU jax
array over the same memory (and a CUDA tensor a GPU array when jax has a GPU backend).

JAX arrays are immutable: results come back as torch tensors over JAX's buffers, and in-place ops
(residual, rotary) copy the result into the caller's tensor with `copy_`.
"""

from __future__ import annotations

import jax
import torch


def to_jax(tensor: torch.Tensor | None, device: jax.Device | None = None) -> jax.Array | None:
    """A jax array viewing `tensor` (made contiguous first if it is not; DLPack needs row-major).
    With `device`, the array is moved there (e.g. a TPU) after the zero-copy import."""
    if tensor is None:
        return None
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    array = jax.dlpack.from_dlpack(tensor.detach())
    if device is not None and array.devices() != {device}:
        array = jax.device_put(array, device)
    return array


def to_torch(array: jax.Array, like: torch.Tensor | None = None) -> torch.Tensor:
    """A torch tensor viewing `array` (moved to `like`'s device if JAX computed elsewhere, e.g. a TPU)."""
    if like is not None and like.device.type == "cpu" and next(iter(array.devices())).platform != "cpu":
        array = jax.device_put(array, jax.devices("cpu")[0])
    return torch.from_dlpack(array)
