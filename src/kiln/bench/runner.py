"""`kiln bench`'s engine: time each case's Kiln implementation and baselines, place it on the roofline.

Per case: input copies (fresh random, from the spec's `make_inputs`, one seed per copy) enough to
flush L2; the implementation that dispatch would pick for the device (or `backend`) timed with
`kiln.bench.timing`; each baseline (and each other Kiln backend asked for with `compare_backends`)
timed on the same copies; speed-up = baseline / Kiln time.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Sequence

import torch

from kiln.bench.ceilings import Ceilings
from kiln.bench.roofline import roofline
from kiln.bench.suites import Case, dtype_name
from kiln.bench.timing import Timing, copies_to_flush, tensor_bytes, time_fn
from kiln.ops.registry import BaselineNotApplicable, OpSpec


def pick_backend(spec: OpSpec, device: torch.device, backend: str | None) -> str:
    """The implementation to time: `backend` if given (must run here), else what dispatch picks,
    except that the Triton interpreter is never timed unless asked for (its numbers mean nothing)."""
    backend = backend or os.environ.get("KILN_BACKEND") or None
    if backend:
        return spec.select(device, backend).name
    if device.type != "cuda":
        return (
            "cpu"
            if "cpu" in spec.implementations and spec.implementations["cpu"].is_available(device)
            else "reference"
        )
    return spec.select(device, None).name


def make_input_sets(
    spec: OpSpec,
    shape: dict,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    max_copies: int | None = None,
) -> list[dict]:
    """Input copies (seeds seed, seed+1, ...; or, for a spec with copy_inputs, copies of the first in
    new memory) that together exceed twice the L2 cache on CUDA. On the CPU at most 4 by default: CPU
    numbers are CI smoke timings, not worth gigabytes of inputs."""
    if max_copies is None:
        max_copies = 64 if device.type == "cuda" else 4
    first = spec.make_inputs(shape, dtype, device, torch.Generator().manual_seed(seed))
    copies = copies_to_flush(tensor_bytes(first), device, max_copies=max_copies)
    if spec.copy_inputs is not None:
        return [first] + [spec.copy_inputs(first) for _ in range(1, copies)]
    return [first] + [
        spec.make_inputs(shape, dtype, device, torch.Generator().manual_seed(seed + i))
        for i in range(1, copies)
    ]


def _timing_fields(t: Timing) -> dict:
    return {
        "median_ms": float(t.median_ms),
        "p20_ms": float(t.p20_ms),
        "p80_ms": float(t.p80_ms),
        "rel_spread": float(t.rel_spread),
        "reps": t.reps,
        "copies": t.copies,
        "method": t.method,
    }


# CPU runs are CI smoke timings: skip LLM-sized cases (a shared CPU runs them 10-100x slower than the
# memcpy ceiling suggests, so a full suite would take hours).
CPU_CASE_LIMIT_S = 0.01
CPU_CASE_LIMIT_BYTES = 256e6


def _fits_cpu_run(flops: float, nbytes: float, ceilings: Ceilings) -> bool:
    bound = max(flops / ceilings.peak_flops(), nbytes / ceilings.peak_bandwidth)
    return bound <= CPU_CASE_LIMIT_S and nbytes <= CPU_CASE_LIMIT_BYTES


def bench_case(
    case: Case,
    device: torch.device,
    ceilings: Ceilings,
    backend: str | None = None,
    baselines: bool = True,
    timing_kwargs: dict | None = None,
    compare_backends: Sequence[str] = (),
) -> dict:
    """One result record (see kiln.bench.results for the fields). `compare_backends`: other Kiln
    implementations of the op timed on the same inputs, recorded as baselines "kiln_<name>" (an
    implementation the op lacks or that cannot run on `device` is recorded with its error)."""
    spec, shape, dtype = case.spec, case.shape, case.dtype
    timing_kwargs = timing_kwargs or {}
    flops, nbytes = spec.flops(shape, dtype), spec.bytes(shape, dtype)
    record: dict = {
        "op": spec.name,
        "shape": dict(shape),
        "dtype": dtype_name(dtype),
        "backend": backend or "?",
        "method": None,
        "median_ms": None,
        "p20_ms": None,
        "p80_ms": None,
        "rel_spread": None,
        "reps": None,
        "copies": None,
        "flops": float(flops),
        "bytes": float(nbytes),
        "tflops": None,
        "gbps": None,
        "intensity": None,
        "roofline_bound_ms": None,
        "roofline_fraction": None,
        "limiter": None,
        "baselines": {},
        "error": None,
    }
    if device.type != "cuda" and not _fits_cpu_run(flops, nbytes, ceilings):
        estimate = max(flops / ceilings.peak_flops(), nbytes / ceilings.peak_bandwidth)
        record["error"] = f"skipped on CPU: about {estimate:.2f} s per call; pass smaller --shapes"
        return record
    try:
        name = pick_backend(spec, device, backend)
        record["backend"] = name
        impl = spec.implementation(name)
        input_sets = make_input_sets(spec, shape, dtype, device)
        timing = time_fn(lambda inputs: impl.fn(**inputs), input_sets, device, **timing_kwargs)
    except Exception as exc:  # a case that cannot run is reported, the rest of the suite goes on
        record["error"] = f"{type(exc).__name__}: {exc}"
        return record
    record.update(_timing_fields(timing))
    # bytes the timed calls rotate through (copies of the inputs, by the byte model): below about twice
    # the last-level cache the inputs stay cached and the memory roofline is not a bound
    record["rotated_bytes"] = float(timing.copies * nbytes) if timing.copies else None
    seconds = timing.median_ms / 1e3
    point = roofline(
        flops, nbytes, seconds, ceilings.peak_flops(spec.peak_dtype(shape, dtype)), ceilings.peak_bandwidth
    )
    record.update(
        {
            "tflops": point.flops_per_s / 1e12,
            "gbps": point.bytes_per_s / 1e9,
            "intensity": float(point.intensity),
            "roofline_bound_ms": point.bound_s * 1e3,
            "roofline_fraction": point.fraction,
            "limiter": point.limiter,
        }
    )
    others = {
        f"kiln_{other}": functools.partial(_run_implementation, spec, device, other)
        for other in compare_backends
        if other != name
    }
    if baselines or others:
        for base_name, fn in {**(spec.baselines if baselines else {}), **others}.items():
            try:
                t = time_fn(lambda inputs, fn=fn: fn(**inputs), input_sets, device, **timing_kwargs)
            except BaselineNotApplicable:
                continue
            except Exception as exc:  # e.g. a CUDA-only library on the CPU
                record["baselines"][base_name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            record["baselines"][base_name] = {
                "median_ms": float(t.median_ms),
                "p20_ms": float(t.p20_ms),
                "p80_ms": float(t.p80_ms),
                "speedup": float(t.median_ms / timing.median_ms),
                # a baseline that syncs with the host cannot be graph-captured: it is timed eagerly,
                # launch gaps included, while Kiln's kernel may be graph-replayed
                "method": t.method,
            }
    del input_sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _run_implementation(spec: OpSpec, device: torch.device, name: str, **inputs):
    """Implementation `name` of `spec` on `inputs` (ValueError if the op lacks it or it cannot run on
    `device`)."""
    return spec.select(device, name).fn(**inputs)


def bench(
    cases: list[Case],
    device: torch.device,
    ceilings: Ceilings,
    backend: str | None = None,
    baselines: bool = True,
    timing_kwargs: dict | None = None,
    progress: Callable[[dict], None] | None = None,
    compare_backends: Sequence[str] = (),
) -> list[dict]:
    """Bench every case; `progress(record)` after each."""
    records = []
    for case in cases:
        record = bench_case(case, device, ceilings, backend, baselines, timing_kwargs, compare_backends)
        records.append(record)
        if progress:
            progress(record)
    return records


def print_progress(record: dict) -> None:
    if record["error"]:
        status = f"ERROR {record['error']}"
    else:
        fraction = 100 * record["roofline_fraction"]
        status = f"{record['median_ms'] * 1e3:10.1f} us  {fraction:5.1f}% of roofline"
    print(
        f"  {record['op']:<22} {record['dtype']:<9} {record['backend']:<10} {record['shape']}  {status}",
        file=sys.stderr,
        flush=True,
    )
