"""Argument checks for the kiln.jax API, worded like the torch API's (`kiln.ops.checks`): each failure
is a ValueError naming the op, the argument and what was expected, raised at trace time (shapes and
dtypes are static under jax.jit), before any kernel runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


def check_array(
    op: str,
    name: str,
    array: object,
    *,
    ndim: int | Sequence[int] | None = None,
    min_ndim: int | None = None,
    dtypes: Iterable | None = None,
) -> jax.Array:
    """Validate one array argument (a jax array or tracer) and return it."""
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        raise ValueError(f"{op}: {name} must be a jax array, got {type(array).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if array.ndim not in allowed:
            raise ValueError(
                f"{op}: {name} must have {' or '.join(map(str, allowed))} dims, "
                f"got shape {tuple(array.shape)}"
            )
    if min_ndim is not None and array.ndim < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dims, got shape {tuple(array.shape)}")
    if dtypes is not None:
        allowed = [jnp.dtype(d) for d in dtypes]
        if jnp.dtype(array.dtype) not in allowed:
            names = ", ".join(_dtype_name(d) for d in allowed)
            raise ValueError(f"{op}: {name} has dtype {_dtype_name(array.dtype)}, expected one of {names}")
    return array


def check_last_dim(op: str, name: str, array, size: int, what: str) -> None:
    if array.shape[-1] != size:
        raise ValueError(f"{op}: {name} has last dim {array.shape[-1]}, expected {what} {size}")


def check_same_dtype(op: str, **arrays) -> None:
    dtypes = {name: jnp.dtype(a.dtype) for name, a in arrays.items() if a is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d.name}" for n, d in dtypes.items())
        raise ValueError(f"{op}: tensors must share one dtype, got {listing}")


def check_shape(op: str, name: str, array, expected: tuple, what: str = "") -> None:
    if tuple(array.shape) != tuple(expected):
        suffix = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} has shape {tuple(array.shape)}, expected {tuple(expected)}{suffix}")
