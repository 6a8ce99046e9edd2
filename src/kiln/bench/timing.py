"""Timing one callable honestly.

CUDA: warm-up (which also compiles Triton kernels), then CUDA-graph replay of one call per input copy
(launch overhead out of the number, as in the engine's own decode graphs), timed with CUDA events; the
input copies together exceed twice the L2 cache, so every call reads cold memory. If the callable
cannot be captured (it synchronizes, or allocates in a way the graph refuses), eager calls timed with
events. CPU: `time.perf_counter` around one pass over the copies, few reps (CI-sized).

Each sample is the time of one call (a pass over the copies divided by their number); the result is
the median and the p20/p80 spread over samples.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_L2_BYTES = 50 * 2**20  # H100's L2, when the device does not report its own


@dataclass
class Timing:
    """Per-call times in milliseconds. `method`: cuda-graph, cuda-events or cpu-wallclock."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    reps: int
    copies: int
    method: str

    @property
    def rel_spread(self) -> float:
        """(p80 - p20) / median: the run's own noise, used by `kiln bench compare`."""
        return (self.p80_ms - self.p20_ms) / self.median_ms if self.median_ms > 0 else math.inf


def quantile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile, q in [0, 1]."""
    ordered = sorted(samples)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(samples_ms: Sequence[float], copies: int, method: str) -> Timing:
    if not samples_ms:
        raise ValueError("timing: no samples")
    return Timing(
        statistics.median(samples_ms),
        quantile(samples_ms, 0.2),
        quantile(samples_ms, 0.8),
        len(samples_ms),
        copies,
        method,
    )


def l2_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)
    return 32 * 2**20  # a typical last-level cache slice; CPU runs are CI-sized anyway


def tensor_bytes(value: Any) -> int:
    """Total bytes of the tensors in a (nested) inputs structure."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def copies_to_flush(
    input_bytes: int, device: torch.device, max_copies: int = 64, memory_budget: int | None = None
) -> int:
    """How many input copies to rotate through so they exceed 2x the L2 cache, within a memory budget."""
    target = 2 * l2_cache_bytes(device)
    copies = max(1, math.ceil(target / max(input_bytes, 1)))
    if memory_budget is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            memory_budget = free // 4
        else:
            memory_budget = 64 * 2**20
    copies = min(copies, max_copies, max(1, memory_budget // max(input_bytes, 1)))
    return int(copies)


def time_fn(
    fn: Callable[[dict], Any],
    input_sets: Sequence[dict],
    device: torch.device,
    *,
    warmup: int | None = None,
    reps: int | None = None,
    budget_s: float | None = None,
    use_graph: bool = True,
) -> Timing:
    """Time `fn(inputs)` rotating over `input_sets` (one call per set per sample).

    warmup/reps/budget_s default to CUDA-sized (3 warm-up passes, up to 50 samples or 0.25 s) or
    CPU-sized (1 warm-up pass, up to 5 samples or 0.5 s) values; at least 3 samples are taken.
    """
    if not input_sets:
        raise ValueError("time_fn: no input sets")
    if device.type == "cuda":
        return _time_cuda(
            fn,
            input_sets,
            device,
            warmup if warmup is not None else 3,
            reps or 50,
            budget_s or 0.25,
            use_graph,
        )
    return _time_cpu(fn, input_sets, warmup if warmup is not None else 1, reps or 5, budget_s or 0.5)


def _time_cpu(fn, input_sets, warmup: int, reps: int, budget_s: float) -> Timing:
    for _ in range(warmup):
        for inputs in input_sets:
            fn(inputs)
    samples = []
    start_all = time.perf_counter()
    while len(samples) < reps and (len(samples) < 3 or time.perf_counter() - start_all < budget_s):
        start = time.perf_counter()
        for inputs in input_sets:
            fn(inputs)
        samples.append((time.perf_counter() - start) * 1e3 / len(input_sets))
    return summarize(samples, len(input_sets), "cpu-wallclock")


def _time_cuda(fn, input_sets, device, warmup: int, reps: int, budget_s: float, use_graph: bool) -> Timing:
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture wants
            for _ in range(warmup):
                for inputs in input_sets:
                    fn(inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = _capture(fn, input_sets) if use_graph else None
        if graph is not None:
            run, method = graph.replay, "cuda-graph"
        else:

            def run():
                for inputs in input_sets:
                    fn(inputs)

            method = "cuda-events"
        run()
        torch.cuda.synchronize()
        samples = []
        start_all = time.perf_counter()
        while len(samples) < reps and (len(samples) < 10 or time.perf_counter() - start_all < budget_s):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / len(input_sets))
        return summarize(samples, len(input_sets), method)


def _capture(fn, input_sets) -> torch.cuda.CUDAGraph | None:
    """A graph of one call per input set, or None when the callable cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for inputs in input_sets:
                fn(inputs)
        torch.cuda.synchronize()
        return graph
    except Exception:  # not capturable (host sync, CPU tensors, ...): fall back to eager timing
        torch.cuda.synchronize()
        return None
