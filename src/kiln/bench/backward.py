"""`kiln bench --backward`: forward + backward of the differentiable ops against plain PyTorch autograd
(eager, and torch.compile of the same forward) in the same run, with peak memory.

Per case (an op with a backward, a shape, a dtype): input copies from the spec's `make_inputs` (the
inputs that have a gradient made leaves); one timed call = the forward (kiln.ops.autograd, KILN_BACKEND
as dispatch or --backend picks) and torch.autograd.grad of its outputs against fixed random upstream
gradients, for every leaf; the baselines (kiln.bench.backward_baselines) timed the same way on the same
copies; Liger-Kernel's kernels too where it is installed and the device is CUDA
(kiln.bench.backward_liger; otherwise the JSON says why not). speedup = baseline median / Kiln median.

Peak memory of one forward + backward on the first copy, above what was allocated before it (the
inputs): on CUDA torch.cuda.max_memory_allocated after reset_peak_memory_stats ("cuda-max-allocated");
on the CPU the running sum of PyTorch's CPU allocation events recorded by torch.profiler with
profile_memory=True ("cpu-profiler-allocations": tensors PyTorch allocates, not Python objects).
No roofline: Kiln has no FLOP/byte model of the backward kernels, so the JSON holds times, ratios and
memory only (kind "kiln-bench-backward").
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.bench.backward_baselines import BASELINES
from kiln.bench.backward_liger import liger_baselines
from kiln.bench.runner import make_input_sets
from kiln.bench.suites import Case, dtype_name, parse_shapes
from kiln.bench.timing import time_fn
from kiln.ops.cpu_inductor import compile_cpu
from kiln.verify.grad import forced_backend
from kiln.verify.grad_ops import GRAD_OPS

KIND = "kiln-bench-backward"


def resolve_backward_cases(
    ops: list[str] | None, suite: str, shapes: str | None, dtypes: list[str] | None, device: torch.device
) -> list[Case]:
    """(op, shape, dtype) cases for the ops with a backward (all of them by default)."""
    from kiln.bench.suites import default_dtypes, dtype_from_name

    unknown = [name for name in ops or [] if name not in GRAD_OPS]
    if unknown:
        raise ValueError(
            f"kiln bench --backward: op(s) {', '.join(unknown)} have no backward; "
            f"known: {', '.join(GRAD_OPS)}"
        )
    cases = []
    for name in ops or list(GRAD_OPS):
        spec = GRAD_OPS[name].spec
        op_dtypes = [dtype_from_name(d) for d in dtypes] if dtypes else default_dtypes(spec, device)
        for dtype in (d for d in op_dtypes if d in spec.dtypes):
            cases.extend(Case(spec, shape, dtype) for shape in parse_shapes(shapes, spec, suite))
    return cases


def _leaf_sets(input_sets: list[dict], wrt: list[str]) -> list[dict]:
    return [{k: (v.requires_grad_() if k in wrt else v) for k, v in inputs.items()} for inputs in input_sets]


def fwd_bwd(forward: Callable[[dict], tuple], wrt: list[str], outputs: int) -> Callable[[dict], None]:
    """inputs -> None: forward, then the gradients of every `wrt` input (torch.autograd.grad, so
    nothing accumulates in .grad between calls) from the first `outputs` outputs. The upstream
    gradients are drawn at the first call and reused."""
    upstream: list[torch.Tensor] = []

    def run(inputs: dict) -> None:
        outs = tuple(forward(inputs))[:outputs]
        if not upstream:
            generator = torch.Generator().manual_seed(0)
            upstream.extend(
                torch.randn(o.shape, generator=generator).to(device=o.device, dtype=o.dtype) for o in outs
            )
        torch.autograd.grad(outs, [inputs[n] for n in wrt], upstream)

    return run


def peak_memory(fn: Callable[[dict], None], inputs: dict, device: torch.device) -> dict:
    """{"bytes": peak bytes above those allocated before the call, "method": ...} of one fn(inputs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn(inputs)
        torch.cuda.synchronize(device)
        return {
            "bytes": int(torch.cuda.max_memory_allocated(device) - before),
            "method": "cuda-max-allocated",
        }
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(inputs)
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return {"bytes": int(peak), "method": "cpu-profiler-allocations"}


def _timed(fn, input_sets, device, timing_kwargs) -> dict:
    t = time_fn(fn, input_sets, device, use_graph=False, **timing_kwargs)
    return {
        "median_ms": float(t.median_ms),
        "p20_ms": float(t.p20_ms),
        "p80_ms": float(t.p80_ms),
        "reps": t.reps,
        "copies": t.copies,
        "method": t.method,
    }


def bench_backward_case(
    case: Case,
    device: torch.device,
    backend: str | None = None,
    baselines: bool = True,
    compile_baseline: bool = True,
    timing_kwargs: dict | None = None,
) -> dict:
    """One record: {"op", "shape", "dtype", "backend", "mode": "fwd_bwd", timing fields, "peak_memory",
    "baselines": {name: timing fields + "speedup" + "peak_memory" + "memory_ratio", or {"error"}, or
    {"skipped": why} (Liger-Kernel absent or off CUDA)}, "error"}. memory_ratio = baseline peak / Kiln
    peak."""
    op = GRAD_OPS[case.spec.name]
    backend = backend or ("triton" if device.type == "cuda" else "cpu")
    record: dict = {
        "op": op.name,
        "shape": dict(case.shape),
        "dtype": dtype_name(case.dtype),
        "backend": backend,
        "mode": "fwd_bwd",
        "baselines": {},
        "error": None,
    }
    timing_kwargs = timing_kwargs or {}
    try:
        input_sets = make_input_sets(case.spec, case.shape, case.dtype, device)
        wrt = op.inputs_with_grad(input_sets[0])
        input_sets = _leaf_sets(input_sets, wrt)
        baseline = BASELINES[op.name]
        outputs = len(baseline(**input_sets[0]))
        kiln_fn = fwd_bwd(op.forward, wrt, outputs)
        with forced_backend(backend):
            record.update(_timed(kiln_fn, input_sets, device, timing_kwargs))
            record["peak_memory"] = peak_memory(kiln_fn, input_sets[0], device)
    except Exception as exc:  # a case that cannot run is reported; the others go on
        record["error"] = f"{type(exc).__name__}: {exc}"
        return record
    if not baselines:
        return record
    candidates = {"torch_eager": baseline}
    if compile_baseline:
        compile_fn = compile_cpu if torch.device(device).type == "cpu" else torch.compile
        candidates["torch_compile"] = compile_fn(baseline, dynamic=False)
    liger, skipped = liger_baselines(op.name, device)
    candidates.update(liger)
    record["baselines"].update({name: {"skipped": why} for name, why in skipped.items()})
    for name, forward in candidates.items():
        fn = fwd_bwd(lambda inputs, forward=forward: forward(**inputs), wrt, outputs)
        try:
            entry = _timed(fn, input_sets, device, timing_kwargs)
            entry["peak_memory"] = peak_memory(fn, input_sets[0], device)
        except Exception as exc:  # e.g. no C++ compiler for torch.compile on the CPU
            record["baselines"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        entry["speedup"] = entry["median_ms"] / record["median_ms"]
        kiln_peak = record["peak_memory"]["bytes"]
        entry["memory_ratio"] = entry["peak_memory"]["bytes"] / kiln_peak if kiln_peak else None
        record["baselines"][name] = entry
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def format_backward_table(records: list[dict]) -> str:
    """Markdown: one row per case, Kiln's fwd+bwd time and peak, then each baseline's ratios."""
    names = sorted({n for r in records for n in r["baselines"]})
    header = ["op", "shape", "dtype", "backend", "fwd+bwd us", "peak MiB"]
    header += [f"{n} speedup" for n in names] + [f"{n} peak MiB" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        row = [r["op"], shape, r["dtype"], r["backend"]]
        if r["error"]:
            row += [f"error: {r['error'][:80]}"] + [""] * (len(header) - 5)
        else:
            row += [f"{r['median_ms'] * 1e3:.1f}", f"{r['peak_memory']['bytes'] / 2**20:.2f}"]
            bases = [r["baselines"].get(n, {}) for n in names]
            row += [
                f"{b['speedup']:.2f}x"
                if "speedup" in b
                else "skipped"
                if "skipped" in b
                else "error"
                if b
                else ""
                for b in bases
            ]
            row += [f"{b['peak_memory']['bytes'] / 2**20:.2f}" if "peak_memory" in b else "" for b in bases]
        lines.append("| " + " | ".join(str(c).replace("|", "/") for c in row) + " |")
    lines.append("")
    lines.append(
        "speedup = baseline fwd+bwd median / Kiln's (>1: Kiln faster). Peak = bytes allocated above the "
        "inputs during one fwd+bwd (CUDA: max_memory_allocated; CPU: torch.profiler allocation events)."
    )
    return "\n".join(lines) + "\n"


def run_backward(args, device: torch.device) -> int:
    """`kiln bench --backward`: bench, print the table, write <out>/<date>-<device>-fwd-bwd.json + .md."""
    from kiln.bench import results
    from kiln.bench.ceilings import device_name as name_of_device

    try:
        cases = resolve_backward_cases(args.op, args.suite, args.shapes, args.dtype, device)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not cases:
        print("kiln bench --backward: nothing to run", file=sys.stderr)
        return 2
    timing_kwargs = {"reps": args.reps} if args.reps else {}
    records = []
    for case in cases:
        record = bench_backward_case(
            case, device, args.backend, not args.no_baselines, not args.no_compile, timing_kwargs
        )
        status = record["error"] or f"{record['median_ms'] * 1e3:.1f} us fwd+bwd"
        print(f"  {record['op']:<28} {record['dtype']:<9} {record['shape']}  {status}", file=sys.stderr)
        records.append(record)
    metadata = results.collect_metadata(
        device, name_of_device(device), args.shapes or args.suite, args.backend
    )
    payload = {"kind": KIND, "schema_version": 1, "metadata": metadata, "cases": records}
    suffix = "fwd-bwd" + (f"-{args.suffix}" if args.suffix else "")
    path = Path(args.out) / results.result_filename(metadata, suffix)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    table = format_backward_table(records)
    path.with_suffix(".md").write_text(table)
    print(table)
    print(f"wrote {path}")
    return 1 if all(r["error"] for r in records) else 0
