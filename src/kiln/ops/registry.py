"""The op registry: one `OpSpec` per op, any number of `Implementation`s behind it.

An op is declared once (its reference, how to make inputs for a shape, its FLOP and byte model,
its tolerances) and implemented per backend ("triton", "cpu", "pallas_tpu", "pallas_gpu", "xla").
Every implementation takes and returns torch tensors with the public op's signature, so one verifier
(`kiln.verify`) and one benchmark (`kiln.bench`) serve them all.

Dispatch (`OpSpec.__call__`, used by every public function in `kiln.ops`):
  1. `KILN_BACKEND=<name>` forces an implementation ("reference" is always allowed);
  2. CUDA tensors take "triton";
  3. anything else takes "cpu" when the op has a fast CPU path, else the reference (which computes
     in at least float32 for half-precision inputs, so it is an honest CPU path for simple ops).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Shape = dict[str, Any]
Inputs = dict[str, Any]


def triton_interpreting() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device | None) -> bool:
    """Triton runs on CUDA devices, or anywhere under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device is None:
        return torch.cuda.is_available() or triton_interpreting()
    return device.type == "cuda" or triton_interpreting()


def always_available(device: torch.device | None) -> bool:
    return True


@dataclass
class Implementation:
    """One backend of an op.

    fn:            same signature and results as the public op; takes and returns torch tensors.
    is_available:  whether it can run for tensors on `device` (None = anywhere at all).
    configs:       the tuning search space for a shape (list of config dicts), or None if untunable.
                   A tunable `fn` accepts a `config: dict | None = None` keyword.
    """

    name: str
    fn: Callable[..., Any]
    is_available: Callable[[torch.device | None], bool] = always_available
    configs: Callable[[Shape, torch.dtype], list[dict]] | None = None
    description: str = ""


@dataclass
class OpSpec:
    """Everything Kiln knows about one op, independent of any backend.

    reference:     the definition of correct. Called by the verifier on float64 copies of the inputs;
                   must be short and obviously right. Same signature as the op.
    make_inputs:   (shape, dtype, device, generator) -> kwargs for the op. Fresh random data, never zeros.
    fuzz_shapes:   (random.Random) -> shape dicts for `kiln verify` (odd sizes, edge cases).
    dtypes:        dtypes the op supports (the dtype that `make_inputs` is given).
    tolerance:     dtype -> largest allowed ||out - ref|| / ||ref|| against the float64 reference.
    flops, bytes:  (shape, dtype) -> work and minimum memory traffic, for the roofline.
    outputs:       (result, inputs) -> tuple of tensors to compare. Defaults to the result itself;
                   in-place ops return the tensors they modified.
    bench_shapes:  suite name -> shapes for `kiln bench`.
    baselines:     name -> callable(**inputs) other libraries' way of doing the same (for `kiln bench`).
    gpu_only_dtypes: dtypes whose Triton path is only checked on a GPU (bf16 `tl.dot` is wrong in the
                   Triton interpreter).
    """

    name: str
    reference: Callable[..., Any]
    make_inputs: Callable[[Shape, torch.dtype, torch.device, torch.Generator], Inputs]
    fuzz_shapes: Callable[[Any], list[Shape]]
    dtypes: Sequence[torch.dtype]
    tolerance: dict[torch.dtype, float]
    flops: Callable[[Shape, torch.dtype], float]
    bytes: Callable[[Shape, torch.dtype], float]
    outputs: Callable[[Any, Inputs], tuple[torch.Tensor, ...]] | None = None
    bench_shapes: dict[str, list[Shape]] = field(default_factory=dict)
    baselines: dict[str, Callable[..., Any]] = field(default_factory=dict)
    gpu_only_dtypes: dict[str, Sequence[torch.dtype]] = field(default_factory=dict)
    implementations: dict[str, Implementation] = field(default_factory=dict)
    description: str = ""

    def register(self, impl: Implementation) -> Implementation:
        if impl.name in self.implementations:
            raise ValueError(f"{self.name}: implementation {impl.name!r} registered twice")
        self.implementations[impl.name] = impl
        return impl

    def output_tensors(self, result: Any, inputs: Inputs) -> tuple[torch.Tensor, ...]:
        if self.outputs is not None:
            return tuple(self.outputs(result, inputs))
        if isinstance(result, torch.Tensor):
            return (result,)
        return tuple(result)

    def backends(self) -> list[str]:
        return ["reference", *self.implementations]

    def implementation(self, name: str) -> Implementation:
        if name == "reference":
            return Implementation("reference", self.reference)
        try:
            return self.implementations[name]
        except KeyError:
            known = ", ".join(self.backends())
            raise ValueError(f"{self.name}: no implementation {name!r} (known: {known})") from None

    def select(self, device: torch.device | None, backend: str | None = None) -> Implementation:
        """The implementation that runs for tensors on `device` (see the module docstring)."""
        backend = backend or os.environ.get("KILN_BACKEND") or None
        if backend:
            impl = self.implementation(backend)
            if not impl.is_available(device):
                raise ValueError(
                    f"{self.name}: backend {backend!r} cannot run on device {device}"
                    + (
                        " (set TRITON_INTERPRET=1 to run Triton kernels on the CPU)"
                        if backend == "triton"
                        else ""
                    )
                )
            return impl
        if device is not None and device.type == "cuda" and "triton" in self.implementations:
            return self.implementations["triton"]
        if "cpu" in self.implementations and self.implementations["cpu"].is_available(device):
            return self.implementations["cpu"]
        return self.implementation("reference")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.select(_first_device(args, kwargs)).fn(*args, **kwargs)


def _first_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


_REGISTRY: dict[str, OpSpec] = {}


def register_op(spec: OpSpec) -> OpSpec:
    """Add an op to the global registry (once per name)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"op {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def get_op(name: str) -> OpSpec:
    all_ops()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; registered ops: {', '.join(sorted(_REGISTRY))}") from None


# Backends that live outside kiln.ops because they need an optional package: module -> package.
# Imported only by all_ops() (verify, bench, tune), so a plain `import kiln.ops` never pays for them.
OPTIONAL_BACKEND_MODULES = {"kiln.jax.backends": "jax"}


def all_ops() -> dict[str, OpSpec]:
    """Every registered op: imports `kiln.ops` so each family has registered itself, and the optional
    backend modules whose package is installed."""
    import importlib
    import importlib.util

    import kiln.ops  # noqa: F401

    for module, package in OPTIONAL_BACKEND_MODULES.items():
        if importlib.util.find_spec(package) is not None and importlib.util.find_spec(
            module.rsplit(".", 1)[0]
        ):
            importlib.import_module(module)
    return dict(sorted(_REGISTRY.items()))
