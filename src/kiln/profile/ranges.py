"""Named ranges for profiles: `with kiln.profile.range("decode"):` around an engine phase.

A no-op (one shared null context, no allocation) unless something is listening: a `kiln profile`
session, any active torch.profiler (the range becomes a `record_function`), or KILN_NVTX=1 (also an
NVTX range, for Nsight Systems). `op`/`shape`/`dtype` declare that the range runs one call of a
registered op on that shape, so the profile can put the range's kernels on the roofline.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

_NULL = contextlib.nullcontext()
_NVTX = os.environ.get("KILN_NVTX", "0") not in ("", "0")
_session: list[tuple[str, dict, Any]] | None = None  # (op, shape, dtype) per annotated call


def _listening() -> bool:
    torch_profiling = bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))
    return _session is not None or _NVTX or torch_profiling


class _Range:
    __slots__ = ("name", "op", "shape", "dtype", "_record", "_nvtx")

    def __init__(self, name: str, op: str | None, shape: dict | None, dtype: Any):
        self.name, self.op, self.shape, self.dtype = name, op, shape, dtype
        self._record = None
        self._nvtx = False

    def __enter__(self) -> _Range:
        if _session is not None and self.op is not None:
            _session.append((self.op, dict(self.shape or {}), self.dtype))
        self._record = torch.autograd.profiler.record_function(self.name)
        self._record.__enter__()
        if _NVTX and torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)
            self._nvtx = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(*exc)


def range(name: str, op: str | None = None, shape: dict | None = None, dtype: Any = None):  # noqa: A001
    """Context manager marking `name` in profiles (see the module docstring); cheap when not profiling."""
    if not _listening():
        return _NULL
    return _Range(name, op, shape, dtype)


@contextlib.contextmanager
def session() -> Iterator[list[tuple[str, dict, Any]]]:
    """While open, ranges are recorded and op-annotated ranges are collected into the yielded list."""
    global _session
    previous, _session = _session, []
    try:
        yield _session
    finally:
        _session = previous
