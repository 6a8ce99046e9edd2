"""Run a workload under torch.profiler and turn the trace into a per-kernel table.

A "kernel" is a GPU kernel on CUDA, an operator's self time on the CPU (a range's own self time is
the Python inside it: a row of its own, no op's). Each kernel maps to a registered op: to the
innermost enclosing `kiln::<op>` range (a declared call: every public op call while profiling, or
`kiln.profile.range`), else, being one of Kiln's kernels, to its own op (kiln.profile.kernel_ops: a
Triton kernel by the op package defining it, a native CPU kernel by name), else to the nearest
enclosing Kiln kernel's. Anything else (aten, cuBLAS, copies outside any op call) is no op's. An op
whose calls were declared with their shapes (`OpSpec.call_case`, `range(..., op=, shape=, dtype=)`)
gets a roofline fraction: sum over its calls of max(flops/peak, bytes/bandwidth), divided by the time
of all kernels mapped to it. Kernels of ops without declared shapes have no fraction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.bench.ceilings import Ceilings, measure_ceilings
from kiln.ops import all_ops
from kiln.profile.kernel_ops import kiln_kernel_op, triton_kernel_ops
from kiln.profile.ranges import range as profile_range
from kiln.profile.ranges import session


@dataclass
class KernelRow:
    """One kernel name: calls, total time (microseconds), share of all kernel time, mapped op,
    the op's roofline fraction (None when unknown) and the gap = time x (1 - fraction)."""

    name: str
    calls: int
    total_us: float
    share: float = 0.0
    op: str | None = None
    fraction: float | None = None
    gap_us: float = 0.0


@dataclass
class ProfileReport:
    device: str
    kernels: list[KernelRow] = field(default_factory=list)
    ops: dict[str, dict] = field(default_factory=dict)  # op -> calls, time_us, bound_us, fraction
    total_us: float = 0.0
    trace_path: str | None = None


def _declared_op(parents: list[str], op_names: list[str]) -> str | None:
    """The op of the innermost enclosing `kiln::<op>` range: a declared call beats the kernel's own op
    (SDPA's flash kernel inside paged_decode_attention belongs to paged_decode_attention)."""
    for parent in parents:
        if parent.startswith("kiln::") and parent[len("kiln::") :] in op_names:
            return parent[len("kiln::") :]
    return None


def _kernel_op(name: str, parents: list[str], op_names: list[str], triton_ops: dict) -> str | None:
    """The op of one kernel run (module docstring): its declared call's, its own, or the nearest
    enclosing Kiln kernel's."""
    op = _declared_op(parents, op_names)
    if op is not None:
        return op
    for candidate in (name, *parents):
        is_kiln, op = kiln_kernel_op(candidate, triton_ops)
        if is_kiln:
            return op
    return None


# Ranges whose time is the profiler's own work (declaring calls that ran without their public
# functions, kiln.models.cpu_flat_decode): left out of the report with everything under them.
PROFILER_RANGE_PREFIX = "kiln.profile:"


def _kernel_events(events, device: torch.device) -> list[tuple[str, float, list[str] | None]]:
    """(kernel name, microseconds, names of enclosing events innermost first) for each kernel run;
    None instead of those names for a range's own self time (CPU). Nothing from the profiler's own
    ranges (PROFILER_RANGE_PREFIX) or under them."""
    out = []
    for name, us, parents, is_range in _all_kernel_events(events, device):
        if any(n.startswith(PROFILER_RANGE_PREFIX) for n in (name, *parents)):
            continue
        out.append((name, us, None if is_range else parents))
    return out


def _all_kernel_events(events, device: torch.device) -> list[tuple[str, float, list[str], bool]]:
    out = []
    if device.type == "cuda":
        # kernels hang off the CPU launch (runtime) event that issued them, whose parents are the
        # aten op and any enclosing record_function range
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                for kernel in e.kernels:
                    out.append((kernel.name, kernel.duration, _ancestors(e), False))
        if not out:  # no launch links in this torch build: the device events alone, unmapped by parent
            for e in events:
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    out.append((e.name, e.time_range.elapsed_us(), [], False))
    else:
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
                is_range = bool(getattr(e, "is_user_annotation", False))
                out.append((e.name, e.self_cpu_time_total, _ancestors(e.cpu_parent), is_range))
    return out


def _ancestors(event) -> list[str]:
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def build_report(
    prof, work: list[tuple[str, dict, Any]], device: torch.device, ceilings: Ceilings | None
) -> ProfileReport:
    """The per-kernel table and per-op roofline from a finished torch.profiler run."""
    registry = all_ops()
    op_names = list(registry)
    triton_ops = triton_kernel_ops()
    rows: dict[tuple[str, str | None], KernelRow] = {}
    for name, us, parents in _kernel_events(prof.events(), device):
        # each run maps on its own: the same aten op can belong to different Kiln ops
        op = None if parents is None else _kernel_op(name, parents, op_names, triton_ops)
        row = rows.get((name, op))
        if row is None:
            row = rows[(name, op)] = KernelRow(name, 0, 0.0, op=op)
        row.calls += 1
        row.total_us += us
    report = ProfileReport(str(device), sorted(rows.values(), key=lambda r: -r.total_us))
    report.total_us = sum(r.total_us for r in report.kernels)
    for op, shape, dtype in work:
        entry = report.ops.setdefault(op, {"calls": 0, "time_us": 0.0, "bound_us": 0.0, "fraction": None})
        entry["calls"] += 1
        if ceilings is not None and op in registry:
            spec = registry[op]
            bound = max(
                spec.flops(shape, dtype) / ceilings.peak_flops(spec.peak_dtype(shape, dtype)),
                spec.bytes(shape, dtype) / ceilings.peak_bandwidth,
            )
            entry["bound_us"] += bound * 1e6
    for row in report.kernels:
        row.share = row.total_us / report.total_us if report.total_us else 0.0
        if row.op in report.ops:
            report.ops[row.op]["time_us"] += row.total_us
    for entry in report.ops.values():
        if entry["time_us"] > 0 and entry["bound_us"] > 0:
            entry["fraction"] = entry["bound_us"] / entry["time_us"]
    for row in report.kernels:
        fraction = report.ops.get(row.op, {}).get("fraction") if row.op else None
        row.fraction = fraction
        row.gap_us = row.total_us * (1.0 - min(fraction, 1.0)) if fraction is not None else row.total_us
    return report


def profile_callable(
    step: Callable[[], Any],
    device: torch.device,
    steps: int = 3,
    warmup: int = 1,
    trace: str | None = None,
    ceilings: Ceilings | None = None,
) -> ProfileReport:
    """Profile `steps` calls of `step()` after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with session() as work, profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    report = build_report(prof, list(work), device, ceilings)
    if trace:
        prof.export_chrome_trace(str(trace))
        report.trace_path = str(trace)
    return report


def profile_op(
    op: str,
    shape: dict,
    dtype: torch.dtype,
    device: torch.device,
    backend: str | None = None,
    steps: int = 5,
    trace: str | None = None,
) -> ProfileReport:
    """Profile `steps` calls of a registered op on fresh random inputs (one input copy per call)."""
    from kiln.bench.runner import pick_backend

    spec = all_ops().get(op)
    if spec is None:
        raise ValueError(f"kiln profile: unknown op {op!r}; known: {', '.join(all_ops())}")
    impl = spec.implementation(pick_backend(spec, device, backend))
    inputs = [spec.make_inputs(shape, dtype, device, torch.Generator().manual_seed(i)) for i in range(steps)]
    calls = iter(inputs * 2)  # warm-up reuses the first copy

    def step():
        with profile_range(f"kiln::{op}", op=op, shape=shape, dtype=dtype):
            impl.fn(**next(calls))

    ceilings = measure_ceilings(device)
    return profile_callable(step, device, steps=steps, warmup=1, trace=trace, ceilings=ceilings)
