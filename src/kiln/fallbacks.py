"""Every fallback this process took: a path that was asked for or expected but did not run.

A fallback keeps the process serving (a TMA kernel Triton cannot build -> the pointer kernel; a CUDA
graph that fails to capture -> eager decode), but a benchmark taken after it measures the other
path. So each one is recorded here, process-wide, and the result writers (`kiln bench`, `kiln verify`)
put `taken()` into their JSON and mark the rows it affects instead of reporting them under the name
of the path that did not run.

    kind:   what fell back, a stable name such as "gemm_tma->pointer" or "cuda_graph->eager"
    detail: why, usually the exception's repr
"""

from __future__ import annotations

import threading
import time

# the kinds Kiln records (kiln.bench.results maps each to the benchmark rows it affects)
GEMM_TMA_TO_POINTER = "gemm_tma->pointer"  # dense GEMM: the TMA kernel failed to build or launch
CUDA_GRAPH_TO_EAGER = "cuda_graph->eager"  # engine: decode-graph capture failed, decode runs eagerly

# what a kind replaces, for the result writers: (op, implementation asked for) -> what runs instead
REPLACES: dict[str, dict[tuple[str, str], str]] = {
    # the dense GEMM gives up TMA for the rest of the process: "triton" then runs the pointer kernel
    GEMM_TMA_TO_POINTER: {
        ("linear", "triton"): "triton_pointer",
        ("linear_silu_mul", "triton"): "triton_pointer",
    },
}

_lock = threading.Lock()
_taken: list[dict] = []


def record(kind: str, detail: str) -> None:
    """Record one fallback (thread-safe); the same (kind, detail) twice counts up instead of repeating."""
    with _lock:
        for entry in _taken:
            if entry["kind"] == kind and entry["detail"] == detail:
                entry["count"] += 1
                return
        _taken.append(
            {
                "kind": kind,
                "detail": detail,
                "count": 1,
                "first_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )


def taken() -> list[dict]:
    """Copies of the recorded fallbacks, oldest first: [{"kind", "detail", "count", "first_at"}]."""
    with _lock:
        return [dict(entry) for entry in _taken]


def clear() -> None:
    """Forget every recorded fallback (tests; a runner that starts a fresh measurement)."""
    with _lock:
        _taken.clear()


def replacement(op: str, backend: str, entries: list[dict] | None = None) -> tuple[dict, str] | None:
    """(the fallback entry, the implementation that ran instead) when a fallback in `entries` (default:
    taken()) replaced `backend` of `op`, else None. The fallbacks are sticky for the process, so a
    result writer marks every row of an affected (op, backend), also any run before it was taken."""
    for entry in taken() if entries is None else entries:
        ran = REPLACES.get(entry["kind"], {}).get((op, backend))
        if ran is not None:
            return entry, ran
    return None
