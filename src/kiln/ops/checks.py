"""Argument checks shared by the public ops: each failure is a ValueError naming the op, the
argument and what was expected, raised before any kernel launches.

The checks read only shapes and dtypes (dtypes compared by name), so one validator serves torch
tensors (`kiln.ops`) and jax arrays or tracers (`kiln.jax`); devices are compared for torch tensors
only (pass `device_of(x)`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: object) -> str:
    """'float32' for torch.float32, jnp.float32 and numpy's dtype('float32') alike."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    import numpy as np

    return np.dtype(dtype).name


def is_array(value: object) -> bool:
    """A torch tensor, or an array-like with a shape and a dtype (jax arrays and tracers)."""
    return isinstance(value, torch.Tensor) or (hasattr(value, "shape") and hasattr(value, "dtype"))


def device_of(value: object) -> torch.device | None:
    """The device of a torch tensor; None for anything else (jax arrays are not compared)."""
    return value.device if isinstance(value, torch.Tensor) else None


def check_tensor(
    op: str,
    name: str,
    tensor: object,
    *,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Validate one tensor argument and return it."""
    if not is_array(tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    rank = len(tensor.shape)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if rank not in allowed:
            dims = " or ".join(map(str, allowed))
            raise ValueError(f"{op}: {name} must have {dims} dims, got shape {tuple(tensor.shape)}")
    if min_ndim is not None and rank < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None:
        names = [dtype_name(d) for d in dtypes]
        if dtype_name(tensor.dtype) not in names:
            raise ValueError(
                f"{op}: {name} has dtype {dtype_name(tensor.dtype)}, expected one of {', '.join(names)}"
            )
    if device is not None and isinstance(tensor, torch.Tensor) and tensor.device != device:
        raise ValueError(f"{op}: {name} is on {tensor.device}, expected {device} (all tensors on one device)")
    return tensor


def check_last_dim(op: str, name: str, tensor: torch.Tensor, size: int, what: str) -> None:
    if tensor.shape[-1] != size:
        raise ValueError(f"{op}: {name} has last dim {tensor.shape[-1]}, expected {what} {size}")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: dtype_name(t.dtype) for name, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise ValueError(f"{op}: tensors must share one dtype, got {listing}")


def check_nonempty_rows(op: str, x: object) -> None:
    """Rows of zero width have no scale (amax over nothing): a named error, the same on every backend."""
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: x has shape {tuple(x.shape)}; the last dim (scaled over) must be non-empty")


def row_count(tensor: object) -> int:
    """Rows of a [..., last] tensor or array: the product of its leading dimensions."""
    return math.prod(tensor.shape[:-1])


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[..., n] -> [rows, n], a view where possible. Unlike `reshape(-1, n)` it also takes n == 0
    (a zero-width row is still a row: rms_norm over hidden 0 returns [rows, 0], a GEMM with K 0 zeros)."""
    return tensor.reshape(math.prod(tensor.shape[:-1]), tensor.shape[-1])


def contiguous_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A view whose last dim is contiguous and rows are evenly strided: a copy only when needed."""
    if tensor.dim() >= 1 and tensor.stride(-1) == 1 and tensor.is_contiguous():
        return tensor
    return tensor.contiguous()


def check_block_config(op: str, config: dict, block_keys: Sequence[str]) -> dict:
    """A launch config whose `block_keys` are powers of two and whose num_warps is 1..32 (a power of two)."""
    for key in (*block_keys, "num_warps"):
        value = config.get(key)
        too_big = key == "num_warps" and isinstance(value, int) and value > 32
        if not isinstance(value, int) or value < 1 or value & (value - 1) or too_big:
            raise ValueError(
                f"{op}: config {config} needs {key} a power of two"
                + (" in 1..32" if key == "num_warps" else "")
            )
    return config
