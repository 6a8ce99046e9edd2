"""The op registry: one `OpSpec` per op, any number of `Implementation`s behind it.

An op is declared once, in its `spec.py`: its signature (a `torch.library` schema), its argument
validation, its float64 reference, how to make inputs for a shape, its FLOP and byte model, its
tolerances and its fake (the output shapes, for compilers). `define_op(spec)` generates from that:

  - the public function `kiln.ops.<name>`: validate, then call the implementation selected for the
    tensors' device and dtype (the choice is cached, so a call costs a dictionary lookup);
  - the custom op `torch.ops.kiln.<name>` with its fake, so `torch.compile(fullgraph=True)` and
    CUDA graphs take the kernel as one opaque node;
  - the JAX entry `kiln.jax.<name>` when the op has JAX implementations (`register_jax`), validated
    by the same function on jax arrays.

Backends ("triton", "triton_tma", "cpu", "pallas_tpu", "pallas_gpu", "xla") live in files beside the
spec and register themselves. Every torch implementation has the public function's signature, so
one verifier (`kiln.verify`) and one benchmark (`kiln.bench`) serve them all.

Dispatch, per (device, dtype, KILN_BACKEND):
  1. `KILN_BACKEND=<name>` forces an implementation ("reference" is always allowed);
  2. CUDA tensors take "triton";
  3. anything else takes "cpu" when the op has a fast CPU path, else the reference (which computes
     in at least float32 for half-precision inputs, so it is an honest CPU path for simple ops).

Inside `trusted_inputs()` the public functions skip argument validation: the engine uses it around
the model's forward, whose shapes it built itself. Dispatch and kernels are the same either way.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.ops.testing import upcast_to_float64

Shape = dict[str, Any]
Inputs = dict[str, Any]

# Backends whose kernels are written in JAX (registered with `OpSpec.register_jax`).
JAX_IMPLEMENTATIONS = ("pallas_tpu", "pallas_gpu", "xla")


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


def cpu_only(device: torch.device | None) -> bool:
    """For fast CPU paths: CPU tensors (or no device at all)."""
    return device is None or device.type == "cpu"


_state = threading.local()

# os.environ.get costs ~0.7 us (it encodes the key on every call), a fifth of a public op's whole
# overhead on the engine's hot path; POSIX CPython keeps the bytes mapping it reads in `_data`.
_ENV_DATA = os.environ._data if hasattr(os.environ, "_data") and os.name == "posix" else None


def env_backend() -> str | None:
    """KILN_BACKEND, read on every call (tests and users change it at run time), or None."""
    if _ENV_DATA is not None:
        value = _ENV_DATA.get(b"KILN_BACKEND")
        return os.fsdecode(value) if value else None
    return os.environ.get("KILN_BACKEND") or None


@contextlib.contextmanager
def trusted_inputs(enabled: bool = True) -> Iterator[None]:
    """Within this block (this thread), public ops skip argument validation. For callers that built
    the arguments themselves (the engine's model forward); everything else is unchanged."""
    previous = getattr(_state, "trusted", False)
    _state.trusted = enabled
    try:
        yield
    finally:
        _state.trusted = previous


def validating() -> bool:
    return not getattr(_state, "trusted", False)


class BaselineNotApplicable(Exception):
    """Raised by an OpSpec baseline for a case it has no counterpart of (`kiln bench` leaves it out)."""


@dataclass
class Implementation:
    """One backend of an op.

    fn:            same signature and results as the public op; takes and returns torch tensors.
    is_available:  whether it can run for tensors on `device` (None = anywhere at all).
    configs:       the tuning search space for a shape (list of config dicts), or None if untunable.
                   A tunable `fn` accepts a `config: dict | None = None` keyword.
    traceable:     whether torch.compile may trace into `fn` (plain tensor code, no data-dependent
                   Python such as `.tolist()`). When False, a compiled caller gets the op as one opaque
                   node, `torch.ops.kiln.<name>`, which runs `fn` eagerly (kiln.engine.cpu_compiled_step).
                   A callable decides per call: it takes the call's arguments as given (declare the
                   op's parameters with their defaults) and is evaluated only while tracing, by dynamo
                   itself, so plain Python on dtypes and None-ness (e.g. traceable unless fp8).
    """

    name: str
    fn: Callable[..., Any]
    is_available: Callable[[torch.device | None], bool] = always_available
    configs: Callable[[Shape, torch.dtype], list[dict]] | None = None
    description: str = ""
    traceable: bool | Callable[..., bool] = True


@dataclass
class OpSpec:
    """Everything Kiln knows about one op, independent of any backend.

    schema:        the op's signature as a `torch.library` schema without the name, e.g.
                   "(Tensor x, Tensor weight, float eps=1e-06, Tensor(a!)? residual=None) -> Tensor".
                   Arguments written in place carry `(a!)`; the result is what the custom op returns
                   (fresh tensors only, never an input).
    validate:      (*args) -> None; raises ValueError naming the argument. Called with every argument
                   of the schema, positionally, defaults filled in. Written against shapes and dtypes
                   (`kiln.ops.checks`), so it validates jax arrays for the JAX entry too.
    fake:          (*args) -> the custom op's outputs as empty tensors of the right shape and dtype.
    public_result: (op_result, args) -> what the public function returns, when it differs from the
                   custom op's result (rms_norm returns `(y, residual)` with a residual). Default: same.
    reference:     the definition of correct. Called by the verifier on float64 copies of the inputs;
                   must be short and obviously right. Same signature as the op.
    make_inputs:   (shape, dtype, device, generator) -> kwargs for the op. Fresh random data, never zeros.
    fuzz_shapes:   (random.Random) -> shape dicts for `kiln verify` (odd sizes, edge cases).
    dtypes:        dtypes the op supports (the dtype that `make_inputs` is given).
    tolerance:     dtype -> largest allowed ||out - ref|| / ||ref|| against the float64 reference.
    case_tolerance: (shape, dtype) -> that bound for one case, where it depends on the shape too
                   (prepared_linear: the weight format); default tolerance[dtype]. The verifier also
                   bounds max |out - ref| / max |ref| by twice it (or max_tolerance[dtype]), so one
                   wrong element cannot hide in the norm of a large output.
    max_tolerance: dtype -> that max-error bound, where one element may legitimately err by more
                   than twice the norm bound of the whole output (an fp8 value rounded past a tie).
    call_case:     (*bound) -> (shape, dtype) of one call from its arguments (every argument of the
                   schema, positionally), such that `flops` and `bytes` of that case are the call's: what
                   `kiln profile` puts on the roofline for calls it sees (the engine's). Shapes only,
                   unless a length lives in a tensor (paged attention's seq_lens: read on the host,
                   never while a CUDA graph is captured, when it returns None).
    requires:      Python packages the reference needs beyond Kiln's core (the GGUF ops' decode with
                   `gguf`): `kiln verify` skips the op, naming them, where they are not installed.
    pointwise:     dtype -> bound on kiln.verify.compare.pointwise_error (each element's error in
                   units of the output dtype's rounding), for ops whose every output element is one
                   value rounded once: 1 is one correct rounding, so a kernel that rounds an
                   intermediate to a half, or does its math in one, fails.
    flops, bytes:  (shape, dtype) -> work and minimum memory traffic, for the roofline.
    matmul_dtype:  (shape, dtype) -> the dtype its matrix units multiply in, where it is not the case's
                   dtype (an fp8 or int8 GEMM with bf16 output): the roofline's FLOP ceiling is that
                   dtype's. Default: the case's dtype.
    outputs:       (result, inputs) -> tuple of tensors to compare. Defaults to the result itself;
                   in-place ops return the tensors they modified.
    bench_shapes:  suite name -> shapes for `kiln bench`.
    copy_inputs:   inputs -> another set with the same values in new memory (kiln.ops.testing.
                   clone_inputs), for ops whose inputs are slow to make (weights quantized on the host):
                   `kiln bench` makes its L2-flushing copies with it instead of `make_inputs`.
    baselines:     name -> callable(**inputs) other libraries' way of doing the same (for `kiln bench`);
                   one that does not apply to a case raises BaselineNotApplicable (left out of it).
    gpu_only_dtypes: implementation -> dtypes only checked on a GPU (bf16 `tl.dot` is wrong in the
                   Triton interpreter).
    doc:           the public function's docstring (shapes, dtypes, what is modified in place).
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
    schema: str | None = None
    validate: Callable[..., None] | None = None
    fake: Callable[..., Any] | None = None
    public_result: Callable[[Any, tuple], Any] | None = None
    doc: str = ""
    jax_implementations: dict[str, Callable[..., Any]] = field(default_factory=dict)
    case_tolerance: Callable[[Shape, torch.dtype], float] | None = None
    pointwise: dict[torch.dtype, float] = field(default_factory=dict)
    matmul_dtype: Callable[[Shape, torch.dtype], torch.dtype] | None = None
    max_tolerance: dict[torch.dtype, float] = field(default_factory=dict)
    requires: tuple[str, ...] = ()
    call_case: Callable[..., tuple[Shape, torch.dtype] | None] | None = None
    copy_inputs: Callable[[Inputs], Inputs] | None = None

    def __post_init__(self) -> None:
        self._selected: dict[tuple, Implementation] = {}
        self.source_file: str | None = None
        self.has_untraceable = False  # an implementation is not `traceable` (checked per call)

    # ---- implementations -------------------------------------------------------------------------

    def register(self, impl: Implementation) -> Implementation:
        if impl.name in self.implementations:
            raise ValueError(f"{self.name}: implementation {impl.name!r} registered twice")
        self.implementations[impl.name] = impl
        self.has_untraceable = self.has_untraceable or impl.traceable is not True
        self._selected.clear()
        return impl

    def register_jax(self, implementation: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Add a JAX implementation: `fn` takes jax arrays with the op's signature and returns the
        custom op's outputs followed by the new values of the arguments written in place (JAX arrays
        are immutable). It serves `kiln.jax.<name>` and, through DLPack, the torch implementation of
        the same name (so `kiln verify --backend pallas_tpu` checks it)."""
        if implementation not in JAX_IMPLEMENTATIONS:
            raise ValueError(f"{self.name}: unknown JAX implementation {implementation!r}")
        self.jax_implementations[implementation] = fn
        from kiln.ops import jax_bridge

        if implementation not in self.implementations:
            self.register(
                Implementation(
                    implementation,
                    jax_bridge.torch_function(self, implementation),
                    jax_bridge.available(implementation),
                    description=jax_bridge.DESCRIPTIONS[implementation],
                )
            )
        return fn

    def peak_dtype(self, shape: Shape, dtype: torch.dtype) -> torch.dtype:
        """The dtype whose matmul peak bounds this case: matmul_dtype's where given, else the case's."""
        return self.matmul_dtype(shape, dtype) if self.matmul_dtype is not None else dtype

    def tolerance_for(self, shape: Shape, dtype: torch.dtype) -> float:
        """The error bound of one verification case."""
        if self.case_tolerance is not None:
            return self.case_tolerance(shape, dtype)
        return self.tolerance[dtype]

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
            return Implementation("reference", self._run_reference)
        try:
            return self.implementations[name]
        except KeyError:
            known = ", ".join(self.backends())
            raise ValueError(f"{self.name}: no implementation {name!r} (known: {known})") from None

    def _run_reference(self, *args: Any, **kwargs: Any) -> Any:
        """The reference as an implementation (KILN_BACKEND=reference, or an op with no path for the
        device): it computes on float64 copies of the arguments, then each output is rounded once to
        the dtype the op's contract names (its fake) and each argument written in place gets the
        rounded values; without a fake, the reference runs on the arguments as given."""
        if self.fake is None or self.schema is None:
            return self.reference(*args, **kwargs)
        bound = self.bind(args, kwargs)
        wide = [upcast_to_float64(value) for value in bound]
        result = self.reference(*wide)
        names = list(self.signature.parameters)
        written = {}  # id of a float64 copy the reference wrote (and may return) -> the caller's tensor
        for name in self.mutated_args:
            index = names.index(name)
            if bound[index] is not None:
                bound[index].copy_(wide[index])
                written[id(wide[index])] = bound[index]
        fakes = self.contract_outputs(bound)

        def rounded(value: Any, like: Any) -> Any:
            if id(value) in written:
                return written[id(value)]
            if isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor):
                return value.to(like.dtype)
            return value

        if isinstance(result, (tuple, list)):
            return type(result)(
                rounded(r, fakes[i] if i < len(fakes) else None) for i, r in enumerate(result)
            )
        return rounded(result, fakes[0])

    def contract_outputs(self, bound: tuple) -> list[Any]:
        """The fake's outputs for arguments `bound` (every argument, positionally) as a list: what
        dtypes and shapes the op's outputs have (an op returning nothing: [None])."""
        fake = self.fake(*bound)
        return list(fake) if isinstance(fake, (tuple, list)) else [fake]

    def select(
        self, device: torch.device | None, backend: str | None = None, dtype: torch.dtype | None = None
    ) -> Implementation:
        """The implementation that runs for tensors on `device` (see the module docstring)."""
        backend = backend or env_backend()
        key = (device, dtype, backend)
        impl = self._selected.get(key)
        if impl is None:
            impl = self._selected[key] = self._choose(device, backend)
        return impl

    def _choose(self, device: torch.device | None, backend: str | None) -> Implementation:
        if backend:
            impl = self.implementation(backend)
            if not impl.is_available(device):
                hint = ""
                if backend == "triton":
                    hint = " (set TRITON_INTERPRET=1 to run Triton kernels on the CPU)"
                raise ValueError(f"{self.name}: backend {backend!r} cannot run on device {device}{hint}")
            return impl
        if device is not None and device.type == "cuda" and "triton" in self.implementations:
            return self.implementations["triton"]
        if "cpu" in self.implementations and self.implementations["cpu"].is_available(device):
            return self.implementations["cpu"]
        return self.implementation("reference")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Dispatch without validation (the public function validates first). The engine reaches this
        once per op per layer per step: a dictionary lookup when the choice is cached."""
        tensor = args[0] if args and type(args[0]) is torch.Tensor else _first_tensor(args, kwargs)
        if tensor is None:
            return self.select(None).fn(*args, **kwargs)
        impl = self._selected.get((tensor.device, tensor.dtype, env_backend()))
        if impl is None:
            impl = self.select(tensor.device, dtype=tensor.dtype)
        return impl.fn(*args, **kwargs)

    # ---- the generated entry points ------------------------------------------------------------

    @functools.cached_property
    def signature(self) -> inspect.Signature:
        """The public function's Python signature, from the schema."""
        if self.schema is None:
            raise ValueError(f"{self.name}: no schema declared")
        return _python_signature(self.parsed_schema)

    @functools.cached_property
    def _parameters(self) -> tuple[tuple[str, Any], ...]:
        return tuple((p.name, p.default) for p in self.signature.parameters.values())

    def bind(self, args: tuple, kwargs: dict) -> tuple:
        """Every argument of the schema, positionally, defaults filled in (TypeError as Python's own
        binding raises it for missing, unknown or repeated arguments)."""
        parameters = self._parameters
        if len(args) <= len(parameters):  # by hand: inspect's binding costs ~3.5 us a call
            out, used = list(args), 0
            for name, default in parameters[len(args) :]:
                if name in kwargs:
                    out.append(kwargs[name])
                    used += 1
                elif default is not inspect.Parameter.empty:
                    out.append(default)
                else:
                    break
            else:
                if used == len(kwargs):
                    return tuple(out)
        bound = self.signature.bind(*args, **kwargs)  # raises the TypeError naming what is wrong
        bound.apply_defaults()
        return tuple(bound.arguments.values())

    def check(self, *args: Any, **kwargs: Any) -> tuple:
        """Validate a call's arguments (ValueError on bad ones); returns them bound positionally."""
        try:
            bound = self.bind(args, kwargs)
        except TypeError as error:
            raise ValueError(f"{self.name}: {error}") from None
        if self.validate is not None:
            self.validate(*bound)
        return bound

    @functools.cached_property
    def parsed_schema(self) -> torch._C.FunctionSchema:
        return torch._C.parse_schema(f"kiln::{self.name}{self.schema}")

    @functools.cached_property
    def mutated_args(self) -> tuple[str, ...]:
        """Names of the arguments the op writes in place (`(a!)` in the schema)."""
        arguments = self.parsed_schema.arguments
        return tuple(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)

    @functools.cached_property
    def num_outputs(self) -> int:
        """How many tensors the custom op returns."""
        return len(self.parsed_schema.returns)


def _first_tensor(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _python_signature(parsed: torch._C.FunctionSchema) -> inspect.Signature:
    params = []
    for arg in parsed.arguments:
        kind = inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
        if str(arg.real_type) == "ScalarType" and isinstance(default, int):
            default = _dtype_of_scalar_type(default)
        params.append(inspect.Parameter(arg.name, kind, default=default))
    return inspect.Signature(params)


def _dtype_of_scalar_type(number: int) -> torch.dtype:
    """The torch.dtype of a schema's `ScalarType x=bfloat16` default, which the parser stores as its
    c10::ScalarType number (15): found by parsing each dtype's name the same way."""
    for dtype in (value for value in vars(torch).values() if isinstance(value, torch.dtype)):
        try:
            parsed = torch._C.parse_schema(f"kiln::_(ScalarType d={str(dtype)[len('torch.') :]}) -> ()")
        except RuntimeError:
            continue
        if parsed.arguments[0].default_value == number:
            return dtype
    raise ValueError(f"no torch dtype has ScalarType number {number}")


# ---- the registry ------------------------------------------------------------------------------

_REGISTRY: dict[str, OpSpec] = {}
_LIBRARY = torch.library.Library("kiln", "FRAGMENT")  # kept alive: owns every torch.ops.kiln op


def register_op(spec: OpSpec) -> OpSpec:
    """Add an op to the global registry (once per name)."""
    if spec.name in _REGISTRY:
        raise ValueError(f"op {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


# While a `kiln profile` session runs (kiln.profile.ranges installs it), an object with
#   call(spec, args, kwargs) -> the context each public call runs in (a profiler range declaring the
#                               call's op and case)
#   declare(spec, args, kwargs) -> None: one call that ran without its public function (`declare_call`)
# None otherwise, so that reading this global is the public functions' only cost of being observable.
_call_observer: Any = None


def set_call_observer(observer: Any) -> Any:
    """Install `observer` (or None) around every public op call outside torch.compile's tracing;
    returns the previous one."""
    global _call_observer
    previous, _call_observer = _call_observer, observer
    return previous


def observing() -> bool:
    """Whether a profile watches op calls now (so that `declare_call`'s arguments are worth building)."""
    return _call_observer is not None


def declare_call(name: str, *args: Any, **kwargs: Any) -> None:
    """Tell a running profile that one call of op `name` with these arguments (tensors on the meta
    device will do: cases read shapes) ran its kernels without the public function (the CPU's native
    flat decode). Nothing when nobody profiles."""
    if _call_observer is not None:
        _call_observer.declare(_REGISTRY[name], args, kwargs)


def define_op(spec: OpSpec, module: str | None = None) -> Callable[..., Any]:
    """Register `spec` and generate its public function and its `torch.ops.kiln.<name>` custom op.

    The public function validates its arguments (unless inside `trusted_inputs()`), then calls the
    implementation selected for the first tensor's device and dtype. Returns the public function.
    """
    if spec.schema is None or spec.fake is None:
        raise ValueError(f"{spec.name}: define_op needs a schema and a fake")
    register_op(spec)
    spec.source_file = sys._getframe(1).f_globals.get("__file__")  # the spec.py that defined it (docs)
    signature = spec.signature
    spec._parameters  # noqa: B018  (cached now: torch.compile cannot trace a cached_property's first get)

    state = _state

    def public(*args: Any, **kwargs: Any) -> Any:
        # Trusted (the engine's forward): a flag, then the cached dispatch in OpSpec.__call__.
        if not getattr(state, "trusted", False):
            spec.check(*args, **kwargs)
            if torch.is_grad_enabled() and _needs_grad(args, kwargs):
                raise RuntimeError(_no_backward_message(spec.name))
        if spec.has_untraceable and torch.compiler.is_compiling() and not _traceable(spec, args, kwargs):
            return _opaque_call(spec, args, kwargs)
        if _call_observer is not None and not torch.compiler.is_compiling():
            with _call_observer.call(spec, args, kwargs):
                return spec(*args, **kwargs)
        return spec(*args, **kwargs)

    public.__name__ = public.__qualname__ = spec.name
    public.__doc__ = spec.doc or spec.description
    public.__signature__ = signature  # type: ignore[attr-defined]
    if module is not None:
        public.__module__ = module
    public.spec = spec  # type: ignore[attr-defined]
    _define_custom_op(spec, public)
    return public


def _define_custom_op(spec: OpSpec, public: Callable[..., Any]) -> None:
    _LIBRARY.define(f"{spec.name}{spec.schema}")
    public_result = spec.public_result

    returns_nothing = spec.num_outputs == 0

    def real(*args: Any, **kwargs: Any) -> Any:
        result = public(*args, **kwargs)
        if public_result is not None:
            result = None if returns_nothing else _op_result_from_public(result)
        return result

    def fake(*args: Any, **kwargs: Any) -> Any:
        # traced inside trusted_inputs() (the engine's compiled decode step): shapes only, no checks
        bound = spec.check(*args, **kwargs) if validating() else spec.bind(args, kwargs)
        return spec.fake(*bound)

    _LIBRARY.impl(spec.name, real, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kiln::{spec.name}", fake, lib=_LIBRARY)


def _needs_grad(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return True
        if isinstance(value, (list, tuple)) and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in value
        ):
            return True
    return False


def _no_backward_message(name: str) -> str:
    """The public functions run kernels with no backward: autograd would drop the gradient silently
    (with a warning at best), so a call whose inputs need one is refused."""
    autograd = sys.modules.get("kiln.ops.autograd")
    twin = f"kiln.ops.autograd.{name}" if autograd is not None and hasattr(autograd, name) else None
    if name == "fused_linear_cross_entropy":
        twin = "kiln.ops.autograd.fused_linear_cross_entropy_loss"
    elif name == "flash_attention_with_lse":
        twin = "kiln.ops.autograd.flash_attention(..., return_lse=True)"
    where = f"use {twin}, which is differentiable" if twin else "it is inference-only (no backward)"
    return (
        f"kiln.ops.{name}: an input requires grad, but this function has no backward ({where}); "
        "call it under torch.no_grad() or torch.inference_mode() for inference"
    )


def _traceable(spec: OpSpec, args: tuple, kwargs: dict) -> bool:
    """Whether the implementation this call dispatches to may be traced by torch.compile (evaluated
    while tracing only, so it costs nothing at run time)."""
    tensor = _first_tensor(args, kwargs)
    device, dtype = (None, None) if tensor is None else (tensor.device, tensor.dtype)
    traceable = spec.select(device, dtype=dtype).traceable
    return traceable(*args, **kwargs) if callable(traceable) else traceable


def _opaque_call(spec: OpSpec, args: tuple, kwargs: dict) -> Any:
    """The call as its custom op (one graph node; its implementation runs eagerly), returning what the
    public function returns."""
    result = getattr(torch.ops.kiln, spec.name)(*args, **kwargs)
    if spec.public_result is None:
        return result
    return spec.public_result(result, spec.bind(args, kwargs))


def _op_result_from_public(result: Any) -> Any:
    # A public result that adds in-place arguments to the op's (rms_norm's (y, residual)): the op's
    # own outputs come first, and a custom op may not return its inputs (an op that only writes in
    # place, like rotary_embedding returning (q, k), returns None).
    return result[0] if isinstance(result, tuple) else result
