"""Named ranges for profiles: `with kiln.profile.range("decode"):` around an engine phase.

A no-op (one shared null context, no allocation) unless something is listening: a `kiln profile`
session, any active torch.profiler (the range becomes a `record_function`), or KILN_NVTX=1 (also an
NVTX range, for Nsight Systems). `op`/`shape`/`dtype` declare that the range runs one call of a
registered op on that shape, so the profile can put the range's kernels on the roofline.

While a session is open, every public `kiln.ops` call runs in such a range, `kiln::<op>`, declaring the
case its arguments make (`OpSpec.call_case`): so a profile of any workload (the engine's steps) maps
kernels to the op calls that launched them. A call inside another `kiln::` range is that op's work.
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
_op_depth = 0  # `kiln::` ranges open now (a profiled workload runs its ops on one thread)


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
        global _op_depth
        if self.name.startswith("kiln::"):
            _op_depth += 1
        if _session is not None and self.op is not None:
            _session.append((self.op, dict(self.shape or {}), self.dtype))
        self._record = torch.autograd.profiler.record_function(self.name)
        self._record.__enter__()
        if _NVTX and torch.cuda.is_available():
            torch.cuda.nvtx.range_push(self.name)
            self._nvtx = True
        return self

    def __exit__(self, *exc: Any) -> None:
        global _op_depth
        if self.name.startswith("kiln::"):
            _op_depth -= 1
        if self._nvtx:
            torch.cuda.nvtx.range_pop()
        self._record.__exit__(*exc)


def range(name: str, op: str | None = None, shape: dict | None = None, dtype: Any = None):  # noqa: A001
    """Context manager marking `name` in profiles (see the module docstring); cheap when not profiling."""
    if not _listening():
        return _NULL
    return _Range(name, op, shape, dtype)


def _case(spec, args: tuple, kwargs: dict) -> tuple[dict, Any] | None:
    return spec.call_case(*spec.bind(args, kwargs)) if spec.call_case is not None else None


class _CallObserver:
    """kiln.ops.registry's call observer during a session."""

    @staticmethod
    def call(spec, args: tuple, kwargs: dict):
        """The `kiln::<op>` range of a public call, declaring its case where the op can tell it
        (computed before the range opens, so that its cost is not the op's); inside another op's
        range, nothing (the call is that op's work)."""
        if _op_depth > 0:
            return _NULL
        case = _case(spec, args, kwargs)
        if case is None:
            return _Range(f"kiln::{spec.name}", None, None, None)
        return _Range(f"kiln::{spec.name}", spec.name, *case)

    @staticmethod
    def declare(spec, args: tuple, kwargs: dict) -> None:
        """A call that ran without its public function: its case joins the session's work."""
        if _session is None or _op_depth > 0:
            return
        case = _case(spec, args, kwargs)
        if case is not None:
            _session.append((spec.name, dict(case[0]), case[1]))


@contextlib.contextmanager
def session() -> Iterator[list[tuple[str, dict, Any]]]:
    """While open, ranges are recorded and op-annotated ranges are collected into the yielded list;
    public op calls declare theirs (module docstring)."""
    from kiln.ops.registry import set_call_observer

    global _session
    previous, _session = _session, []
    previous_observer = set_call_observer(_CallObserver())
    try:
        yield _session
    finally:
        _session = previous
        set_call_observer(previous_observer)
