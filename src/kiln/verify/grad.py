"""`kiln verify --grad`: every backward against autograd through the op's float64 reference.

Per case (an op's fuzz shape, a dtype, a backend): fresh random inputs from the spec's `make_inputs`;
the Kiln side runs the differentiable entry point (kiln.ops.autograd) with KILN_BACKEND set to the
backend, so the forward and its backward kernel are that backend's (Triton under the interpreter on a
CPU); every kernel output, gradients included, is allocated poisoned (NaN). The upstream gradient of
each output is fresh random (float64, rounded to the output's dtype for the Kiln side). The reference
is torch.autograd through the float64 definition on float64 copies of the same inputs. One error per
input gradient, ||grad - grad_ref|| / ||grad_ref||, NaN never passing (kiln.verify.compare).
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from kiln.ops.alloc import poisoned
from kiln.ops.registry import triton_interpreting
from kiln.ops.testing import upcast_to_float64
from kiln.text_table import aligned_table
from kiln.verify.compare import errors as compare_errors
from kiln.verify.grad_ops import GRAD_OPS, GradOp
from kiln.verify.report import status
from kiln.verify.runner import MAX_ERROR_FACTOR, dtype_name

GRAD_BACKENDS = ("triton", "cpu")  # KILN_BACKEND values that pick a forward and its backward


@dataclass
class GradRow:
    """One (op, input, backend, dtype) line of the gradient report."""

    op: str
    input: str
    backend: str
    dtype: str
    cases: int = 0
    worst_error: float = 0.0
    tolerance: float = 0.0
    failures: list[dict] = field(default_factory=list)
    skipped: str = ""
    excluded: list[dict] = field(default_factory=list)  # fuzz shapes not checked, with the reason

    @property
    def passed(self) -> bool:
        return not self.skipped and self.cases > 0 and not self.failures


@contextlib.contextmanager
def forced_backend(name: str) -> Iterator[None]:
    """KILN_BACKEND=name inside the block (forward dispatch and kiln.ops.autograd.dispatch read it)."""
    previous = os.environ.get("KILN_BACKEND")
    os.environ["KILN_BACKEND"] = name
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KILN_BACKEND"]
        else:
            os.environ["KILN_BACKEND"] = previous


def _detached_leaves(inputs: dict, names: list[str], dtype: torch.dtype | None = None) -> dict:
    out = dict(inputs)
    for name in names:
        tensor = inputs[name].detach()
        out[name] = (tensor.to(dtype) if dtype is not None else tensor.clone()).requires_grad_()
    return out


def grad_case(
    op: GradOp,
    backend: str,
    shape: dict,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    max_bound: float | None = None,
) -> dict[str, float | str]:
    """{input name: relative error of its gradient} for one case; a crash gives {"*": "Error: ..."}.
    max_bound: a gradient whose max |g - g_ref| / max |g_ref| exceeds it gets a failure message
    instead (as the forward verifier's bound: twice the norm tolerance)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = op.spec.make_inputs(shape, dtype, device, generator)
    names = op.inputs_with_grad(inputs)
    kiln_inputs = _detached_leaves(inputs, names)
    ref_inputs = _detached_leaves(upcast_to_float64(inputs), names)
    try:
        with torch.enable_grad():
            expected = op.reference(ref_inputs)
            # random upstream gradients; zero where the reference output is not finite (-inf LSE)
            upstream = [
                torch.randn(r.shape, generator=generator, dtype=torch.float64).to(r.device)
                * torch.isfinite(r)
                for r in expected
            ]
            ref_grads = torch.autograd.grad(expected, [ref_inputs[n] for n in names], upstream)
            with forced_backend(backend), poisoned():
                got = op.forward(kiln_inputs)
                if len(got) != len(expected):
                    return {"*": f"{len(got)} outputs, the reference has {len(expected)}"}
                grads = torch.autograd.grad(
                    got,
                    [kiln_inputs[n] for n in names],
                    [u.to(g.dtype) for u, g in zip(upstream, got, strict=True)],
                )
    except Exception as exc:  # a crash fails the case, reported with its message
        return {"*": f"{type(exc).__name__}: {exc}"}
    errors: dict[str, float | str] = {}
    for name, grad, ref in zip(names, grads, ref_grads, strict=True):
        if grad is None:
            errors[name] = "no gradient"
            continue
        try:
            norm, worst, _ = compare_errors(grad, ref)
        except ValueError as exc:
            errors[name] = str(exc)
            continue
        errors[name] = norm
        if max_bound is not None and worst > max_bound:  # one wrong element cannot hide in the norm
            errors[name] = (
                f"max |g - g_ref| is {worst:.3e} of max |g_ref| (bound {max_bound:.1e}): some elements are "
                f"wrong though the norm error is {norm:.2e}"
            )
    return errors


def _gpu_only(op: GradOp, backend: str) -> set[torch.dtype]:
    from kiln.ops import all_ops

    dtypes = set(op.spec.gpu_only_dtypes.get(backend, ()))
    for name in op.also_gpu_only:
        dtypes |= set(all_ops()[name].gpu_only_dtypes.get(backend, ()))
    return dtypes


def verify_grad(
    ops: list[str] | None = None,
    backends: list[str] | None = None,
    dtypes: list[str] | None = None,
    device: str | torch.device | None = None,
    seed: int | None = None,
    progress=None,
    max_shapes: int | None = None,
) -> list[GradRow]:
    """Check the gradients of `ops` (default: every op in GRAD_OPS) for each backend in GRAD_BACKENDS
    that runs on `device` (or `backends`), each dtype of the op's spec (or `dtypes`), over the spec's
    fuzz shapes (the first `max_shapes` of them when given). One GradRow per op/input/backend/dtype."""
    from kiln.ops.registry import triton_available

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed = seed if seed is not None else int(time.time_ns() % 2**31)
    rng = random.Random(seed)
    unknown = [name for name in (ops or []) if name not in GRAD_OPS]
    if unknown:
        known = ", ".join(GRAD_OPS)
        raise ValueError(f"kiln verify --grad: no backward for op(s) {', '.join(unknown)}; known: {known}")
    bad = [b for b in (backends or []) if b not in GRAD_BACKENDS]
    if bad:
        raise ValueError(
            f"kiln verify --grad: backend(s) {', '.join(bad)} unknown; use {', '.join(GRAD_BACKENDS)}"
        )
    rows: list[GradRow] = []
    for name, op in GRAD_OPS.items():
        if ops and name not in ops:
            continue
        shapes = op.spec.fuzz_shapes(rng)[:max_shapes]
        for backend in backends or GRAD_BACKENDS:
            runnable = triton_available(device) if backend == "triton" else device.type == "cpu"
            gpu_only = _gpu_only(op, backend) if device.type != "cuda" and triton_interpreting() else set()
            for dtype in op.spec.dtypes:
                if dtypes and dtype_name(dtype) not in dtypes:
                    continue
                new_rows = _run_rows(op, backend, dtype, shapes, device, rng, runnable, dtype in gpu_only)
                rows.extend(new_rows)
                if progress:
                    for row in new_rows:
                        progress(row)
    return rows


def _run_rows(op, backend, dtype, shapes, device, rng, runnable, gpu_only) -> list[GradRow]:
    tol = op.tolerance[dtype]
    rows: dict[str, GradRow] = {
        n: GradRow(op.name, n, backend, dtype_name(dtype), tolerance=tol) for n in op.wrt
    }
    if not runnable or gpu_only:
        reason = "GPU only (Triton interpreter)" if gpu_only else f"not available on {device}"
        for row in rows.values():
            row.skipped = reason
        return list(rows.values())
    for shape in shapes:
        seed = rng.randrange(2**31)
        reason = op.excluded(shape)
        if reason:
            for row in rows.values():
                row.excluded.append({"shape": shape, "reason": reason})
            continue
        errors = grad_case(op, backend, shape, dtype, device, seed, max_bound=MAX_ERROR_FACTOR * tol)
        crash = errors.get("*")
        for name, row in rows.items():
            value = crash if crash is not None else errors.get(name)
            if value is None:
                continue  # this input is absent in this case (e.g. no bias)
            row.cases += 1
            error = value if isinstance(value, float) else float("inf")
            row.worst_error = max(row.worst_error, error)
            if isinstance(value, str) or not error <= tol:
                failure = value if isinstance(value, str) else ""
                row.failures.append({"shape": shape, "seed": seed, "error": error, "failure": failure})
    return [row for row in rows.values() if row.cases or row.skipped or row.excluded]


def format_grad_table(rows: list[GradRow]) -> str:
    """The report: one line per op/input/backend/dtype, then the first failures of each."""
    header = ("op", "grad of", "backend", "dtype", "cases", "worst rel err", "tolerance", "result")
    rows_text = [
        (
            r.op,
            r.input,
            r.backend,
            r.dtype,
            str(r.cases),
            f"{r.worst_error:.2e}" if r.cases else "-",
            f"{r.tolerance:.1e}",
            status(r),
        )
        for r in rows
    ]
    out = aligned_table(header, rows_text).split("\n")
    excluded = {(r.op, str(e["shape"])): e["reason"] for r in rows for e in r.excluded}
    for (op, shape), reason in excluded.items():
        out.append(f"  excluded {op} shape={shape}: {reason}")
    for r in rows:
        for failure in r.failures[:3]:
            out.append(
                f"  FAILED {r.op}/{r.input}/{r.backend}/{r.dtype} shape={failure['shape']} "
                f"seed={failure['seed']}: error={failure['error']:.3e} {failure['failure']}".rstrip()
            )
    return "\n".join(out)


def grad_json(rows: list[GradRow], device: str, complete: bool = True) -> dict:
    """The JSON payload of a gradient run (kind "kiln-verify-grad")."""
    from kiln.environment import environment

    env = environment()
    return {
        "kind": "kiln-verify-grad",
        "version": 1,
        "complete": complete,
        "device": device,
        "device_name": env["gpu_name"] if device.startswith("cuda") else env["cpu_model"] or "cpu",
        "torch": torch.__version__,
        "environment": env,
        "rows": [dict(asdict(r), passed=r.passed) for r in rows],
    }
