"""`kiln verify`: every registered op, every backend that can run here, fuzzed shapes and dtypes,
against its reference computed in float64."""

from __future__ import annotations

import copy
import importlib.util
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kiln.ops import OpSpec, all_ops
from kiln.ops.alloc import poisoned
from kiln.ops.registry import triton_interpreting
from kiln.ops.testing import upcast_to_float64
from kiln.verify.compare import errors

# max |out - ref| / max |ref| may reach this multiple of the norm tolerance (OpSpec.max_tolerance aside)
MAX_ERROR_FACTOR = 2.0
# The Triton interpreter (3.9) converts float32 to bfloat16 by truncation, not to nearest: each
# rounding errs by up to one ulp, twice what rounding to nearest does, so an op's per-element bound
# doubles there (rms_norm's fused residual sum is rounded, then normalized: two truncations). A GPU
# rounds to nearest, so the op's own bound applies there
INTERPRETER_BF16_ROUNDING_FACTOR = 2.0


def _interpreted_triton(backend: str, device: torch.device) -> bool:
    return backend.startswith("triton") and torch.device(device).type != "cuda" and triton_interpreting()


@dataclass
class CaseResult:
    op: str
    backend: str
    dtype: str
    shape: dict
    error: float
    tolerance: float
    seed: int
    failure: str = ""
    crashed: bool = False  # the implementation raised (failure holds the exception)

    @property
    def passed(self) -> bool:
        return not self.failure and self.error <= self.tolerance


@dataclass
class Row:
    """One (op, backend, dtype) line of the report."""

    op: str
    backend: str
    dtype: str
    cases: int = 0
    worst_error: float = 0.0
    tolerance: float = 0.0
    failures: list[dict] = field(default_factory=list)
    skipped: str = ""
    seconds: float = 0.0  # wall time of the row's cases, compiles included (a GPU run's budget)

    @property
    def passed(self) -> bool:
        return not self.skipped and self.cases > 0 and not self.failures


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def clone_inputs(value: Any) -> Any:
    """A copy of the inputs for the implementation; a tensor keeps its strides (a view into a fused
    QKV buffer stays one: `clone()` would make it contiguous, hiding a kernel that assumes so)."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_contiguous():
            return value.detach().clone()
        copied = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
        return copied.copy_(value.detach())
    if isinstance(value, dict):
        return {k: clone_inputs(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_inputs(v) for v in value)
    return copy.deepcopy(value)


def run_case(
    spec: OpSpec, backend: str, shape: dict, dtype: torch.dtype, device: torch.device, seed: int
) -> CaseResult:
    """Run one case: fresh inputs from `seed`, poisoned outputs, compare each output with float64.
    The "cpu" backend, where it cannot take `device`'s tensors (a GPU machine's test run), is checked on
    CPU tensors: its kernels never take CUDA ones. Any other backend runs where `device` says."""
    tol = spec.tolerance_for(shape, dtype)
    result = CaseResult(spec.name, backend, dtype_name(dtype), shape, 0.0, tol, seed)
    impl = spec.implementation(backend)
    device = torch.device(device)
    if backend == "cpu" and device.type != "cpu" and not impl.is_available(device):
        device = torch.device("cpu")
    generator = torch.Generator().manual_seed(seed)
    inputs = spec.make_inputs(shape, dtype, device, generator)
    ref_inputs = upcast_to_float64(inputs)
    impl_inputs = clone_inputs(inputs)
    try:
        expected = spec.output_tensors(spec.reference(**ref_inputs), ref_inputs)
        with poisoned():
            got = spec.output_tensors(impl.fn(**impl_inputs), impl_inputs)
    except Exception as exc:  # a crash is a failure of that case, reported with its message
        result.error = float("inf")
        result.failure, result.crashed = f"{type(exc).__name__}: {exc}", True
        return result
    if len(got) != len(expected):
        result.failure = f"{len(got)} outputs, reference has {len(expected)}"
        result.error = float("inf")
        return result
    contract = _contract_mismatch(spec, inputs, got) or _written_read_only_input(spec, inputs, impl_inputs)
    if contract:
        result.failure, result.error = contract, float("inf")
        return result
    got, expected = _with_written_arguments(spec, got, expected, impl_inputs, ref_inputs)
    max_tol = spec.max_tolerance.get(dtype, MAX_ERROR_FACTOR * tol)
    pointwise = spec.pointwise.get(dtype)
    if pointwise is not None and dtype == torch.bfloat16 and _interpreted_triton(backend, device):
        pointwise *= INTERPRETER_BF16_ROUNDING_FACTOR
    for i, (out, ref) in enumerate(zip(got, expected, strict=True)):
        try:
            err, worst, rounding = errors(out, ref, pointwise is not None and out.is_floating_point())
            if worst > max_tol and not result.failure:
                result.failure = (
                    f"output {i}: max |out - ref| is {worst:.3e} of max |ref| (bound {max_tol:.1e}): "
                    f"some elements are wrong though the norm error is {err:.2e}"
                )
            if rounding is not None and rounding > pointwise and not result.failure:
                result.failure = (
                    f"output {i}: an element errs by {rounding:.2f} roundings of {dtype_name(out.dtype)} "
                    f"(bound {pointwise}): more than the one rounding the op promises"
                )
        except ValueError as exc:
            result.failure = f"output {i}: {exc}"
            err = float("inf")
        result.error = max(result.error, err)
    return result


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads included), whatever the dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _written_read_only_input(spec: OpSpec, inputs: dict, impl_inputs: dict) -> str:
    """The first argument the schema says the op only reads that the implementation changed (a KV
    cache scribbled over after attention read it): its name, else "". `inputs` were never given to
    anything; the implementation ran on clones of them."""
    written = set(spec.mutated_args) if spec.schema is not None else set()
    for name, value in inputs.items():
        if name in written:
            continue
        for before, after in zip(_tensors(value), _tensors(impl_inputs.get(name)), strict=True):
            if before.layout != torch.strided:  # oneDNN's packed weights: opaque, nothing to read
                continue
            if not _same_bits(before, after.detach()):
                return f"argument {name} is read-only in the op's schema, but the implementation changed it"
    return ""


def _with_written_arguments(spec: OpSpec, got: tuple, expected: tuple, impl_inputs: dict, ref_inputs: dict):
    """(got, expected) plus every argument the op writes in place (`(a!)` in its schema) that they do
    not hold already: the implementation's value of it against the reference's, whatever the op's
    `outputs` hook returns (rms_norm's residual, which the engine reads from the argument itself)."""
    if spec.schema is None:
        return got, expected
    got, expected = list(got), list(expected)
    for name in spec.mutated_args:
        out, ref = impl_inputs.get(name), ref_inputs.get(name)
        if isinstance(out, torch.Tensor) and isinstance(ref, torch.Tensor) and all(out is not g for g in got):
            got.append(out)
            expected.append(ref)
    return tuple(got), tuple(expected)


def _contract_mismatch(spec: OpSpec, inputs: dict, got: tuple[torch.Tensor, ...]) -> str:
    """Where an output's dtype or shape differs from what the op's fake (its contract, what compilers
    are told) says for these inputs: the message; "" when they agree or the op has no fake."""
    if spec.fake is None or spec.schema is None:
        return ""
    # inputs as made: the implementation ran on clones, the reference on float64 copies
    fakes = [f for f in spec.contract_outputs(spec.bind((), inputs)) if isinstance(f, torch.Tensor)]
    for i, (out, want) in enumerate(zip(got, fakes, strict=False)):
        if out.dtype != want.dtype or tuple(out.shape) != tuple(want.shape):
            return (
                f"output {i} is {dtype_name(out.dtype)} {tuple(out.shape)}, the op's contract says "
                f"{dtype_name(want.dtype)} {tuple(want.shape)}"
            )
    return ""


def backend_dtypes(
    spec: OpSpec, backend: str, device: torch.device
) -> tuple[list[torch.dtype], list[torch.dtype]]:
    """(dtypes to run, dtypes skipped here) for a backend on a device."""
    skipped = []
    if device.type != "cuda" and triton_interpreting():  # keyed by implementation: "triton", "triton_tma"
        skipped = [d for d in spec.gpu_only_dtypes.get(backend, ()) if d in spec.dtypes]
    return [d for d in spec.dtypes if d not in skipped], skipped


def verify(
    ops: list[str] | None = None,
    backends: list[str] | None = None,
    dtypes: list[str] | None = None,
    device: str | torch.device | None = None,
    seed: int | None = None,
    progress=None,
    shard: tuple[int, int] | None = None,
) -> list[Row]:
    """Verify ops (all registered by default) on every backend available for `device`
    (CUDA if present, else CPU) and return one Row per (op, backend, dtype).
    shard=(i, n): only the i-th (1-based) of every n of the chosen ops that have one of `backends`,
    so n processes side by side cover them all once (a GPU run's Triton compiles are the long part)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    seed = seed if seed is not None else int(time.time_ns() % 2**31)
    rng = random.Random(seed)
    registry = all_ops()
    unknown = [name for name in (ops or []) if name not in registry]
    if unknown:
        raise ValueError(f"kiln verify: unknown op(s) {', '.join(unknown)}; known: {', '.join(registry)}")
    chosen = [spec for name, spec in registry.items() if not ops or name in ops]
    for asked, known, what in (
        (backends, {b for spec in chosen for b in spec.backends()}, "backend"),
        (dtypes, {dtype_name(d) for spec in chosen for d in spec.dtypes}, "dtype"),
    ):
        unknown = sorted(set(asked or ()) - known)
        if unknown:
            names, known_names = ", ".join(unknown), ", ".join(sorted(known))
            raise ValueError(f"kiln verify: unknown {what}(s) {names} for these ops; known: {known_names}")
    if shard is not None:
        chosen = shard_specs(chosen, backends, shard)
    picked = {spec.name for spec in chosen}
    rows: list[Row] = []
    for name, spec in registry.items():
        if name not in picked:
            continue
        missing = [module for module in spec.requires if importlib.util.find_spec(module) is None]
        if missing:
            why = f"its reference needs {', '.join(missing)} (not installed)"
            rows.extend(Row(name, "*", dtype_name(dtype), skipped=why) for dtype in spec.dtypes)
            continue
        # every registered implementation gets its rows: one that cannot run here is SKIP, not absent
        for backend in backends or list(spec.implementations):
            if backend not in spec.backends():
                continue
            if not spec.implementation(backend).is_available(device):
                why = f"not available on {device}"
                asked = [dtype_name(d) for d in spec.dtypes if not dtypes or dtype_name(d) in dtypes]
                rows.extend(Row(name, backend, dtype, skipped=why) for dtype in asked)
                continue
            run_dtypes, skipped = backend_dtypes(spec, backend, device)
            shapes = spec.fuzz_shapes(rng)
            for dtype in spec.dtypes:
                if dtypes and dtype_name(dtype) not in dtypes:
                    continue
                row = Row(name, backend, dtype_name(dtype), tolerance=spec.tolerance[dtype])
                if dtype in skipped:
                    row.skipped = "GPU only (Triton interpreter)"
                    rows.append(row)
                    continue
                start = time.perf_counter()
                for shape in shapes:
                    case = run_case(spec, backend, shape, dtype, device, rng.randrange(2**31))
                    row.cases += 1
                    row.worst_error = max(row.worst_error, case.error)
                    row.tolerance = max(row.tolerance, case.tolerance)
                    if not case.passed:
                        row.failures.append(asdict(case))
                row.seconds = round(time.perf_counter() - start, 3)
                rows.append(row)
                if progress:
                    progress(row)
        _drop_jax_compilations()
    return rows


def shard_specs(specs: list[OpSpec], backends: list[str] | None, shard: tuple[int, int]) -> list[OpSpec]:
    """shard=(i, n): the i-th (1-based) of every n of `specs` that have one of `backends` (all of them
    for None), so n processes side by side (`kiln verify --shard i/n`) cover them once. ValueError
    unless 1 <= i <= n."""
    index, count = shard
    if not 1 <= index <= count:
        raise ValueError(f"kiln verify: shard {index}/{count}: expected 1 <= I <= N")
    having = [spec for spec in specs if not backends or set(backends) & set(spec.backends())]
    return having[index - 1 :: count]


def _drop_jax_compilations() -> None:
    """Free the op's jitted JAX executables (one per shape and dtype): a whole-registry run on the CPU
    compiles thousands (the Pallas interpreters' included) and ran out of memory keeping them all."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()
