"""Ahead-of-time compile sweep: record the Triton launches Kiln's launchers make, compile each for an
H100 (sm_90) without a GPU.

`record_launches()` swaps `JITFunction.run` (what `kernel[grid](...)` calls) for a recorder: each
launch is bound and specialized by Triton's own binder for a `GPUTarget("cuda", 90, 32)` backend, so
the signature ("*bf16", "i32", "tensordesc<fp16[64, 64]>", ...), the `tt.divisibility` 16 marks
(16-byte aligned pointers, multiples of 16), the constexprs (keywords and defaults) and the launch
options (num_warps, num_stages) are what a real launch on the GPU would compile. Nothing runs: the
launch returns, so outputs keep whatever the launcher allocated. Inside the context the process pretends
to be an H100 (132 SMs, compute capability 9.0, TMA kernels enabled) so launchers pick GPU configs.

`compile_spec(spec)` then builds one recorded launch with `triton.compile` and reads the cubin's
resource usage (registers, stack = spill bytes) with Triton's bundled cuobjdump when it is present.

Triton must not be in interpreter mode (TRITON_INTERPRET unset) when the kernels are imported, so the
CLI (`kiln tune aot` or `python -m kiln.tune.aot`; kiln.tune.aot.sweep says which launches it drives)
runs in its own process.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

H100_SMS = 132
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one H100 block can have
_RUNTIME_KWARGS = ("debug", "instrumentation_mode", "fpsan_homomorphic_casts")


@dataclass
class LaunchSpec:
    """One distinct compile a launch needs: the kernel and its specialization.

    signature:  parameter name -> Triton type ("*bf16", "i32", "fp32", "constexpr", "tensordesc<...>").
    constexprs: parameter-path tuple -> value (as Triton's `_pack_args` gives them).
    attrs:      parameter-path tuple -> [["tt.divisibility", 16]] (or []).
    options:    launch options passed at the call (num_warps, num_stages, ...).
    """

    fn: Any = field(repr=False)
    kernel: str
    signature: dict[str, str]
    constexprs: dict[tuple, Any]
    attrs: dict[tuple, list]
    options: dict[str, Any]
    sources: list[str] = field(default_factory=list)  # which drive cases launched it

    def key(self) -> str:
        constexprs = sorted((str(k), _show(v)) for k, v in self.constexprs.items())
        attrs = sorted((str(k), str(v)) for k, v in self.attrs.items())
        return json.dumps([self.kernel, self.signature, constexprs, attrs, sorted(self.options.items())])

    def operand_type(self) -> str:
        """Element type of the kernel's first tensor argument ("bf16", "fp32", ...): the input dtype,
        which tells fp32 launches (IEEE dots, rarely on the GPU's hot path) from 16/8-bit ones."""
        for ty in self.signature.values():
            if ty.startswith("*"):
                return ty[1:]
            if ty.startswith("tensordesc<"):
                return ty[len("tensordesc<") :].split("[", 1)[0]
        return ""

    def constexpr_summary(self) -> str:
        names = list(self.signature)
        parts = [f"{names[path[0]]}={_show(v)}" for path, v in self.constexprs.items() if len(path) == 1]
        parts += [f"{k}={v}" for k, v in sorted(self.options.items())]
        return " ".join(parts)


def _show(value: Any) -> str:
    if hasattr(value, "fn") and hasattr(value.fn, "__qualname__"):  # a JITFunction passed as constexpr
        return value.fn.__qualname__
    return str(value)


def sm90_target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", 90, 32)


class LaunchRecorder:
    """Collects distinct `LaunchSpec`s; `current_source` labels the launches that follow."""

    def __init__(self) -> None:
        from triton.compiler import make_backend

        self.backend = make_backend(sm90_target())
        self.specs: dict[str, LaunchSpec] = {}
        self.current_source = ""
        self.launches = 0  # launches recorded, duplicates included
        self._binders: dict[int, Any] = {}

    def record(self, fn: Any, args: tuple, kwargs: dict) -> None:
        from triton.runtime.jit import create_function_from_signature

        self.launches += 1
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", fn.debug) or False
        compilation = _compilation_knobs()
        for name in _RUNTIME_KWARGS[1:]:
            if compilation is not None and hasattr(compilation, name):
                kwargs[name] = getattr(compilation, name)
        binder = self._binders.get(id(fn))
        if binder is None:  # Triton's own bind-and-specialize, as JITFunction.run uses it
            binder = create_function_from_signature(fn.signature, fn.params, self.backend)
            self._binders[id(fn)] = binder
        bound_args, specialization, options = binder(*args, **kwargs)
        packed = fn._pack_args(self.backend, kwargs, bound_args, specialization, options)
        _, signature, constexprs, attrs = packed
        sigkeys = {p.name for p in fn.params}
        launch_options = {k: v for k, v in kwargs.items() if k not in sigkeys and k not in _RUNTIME_KWARGS}
        if kwargs["debug"]:
            launch_options["debug"] = True
        spec = LaunchSpec(
            fn=fn,
            kernel=f"{fn.fn.__module__}.{fn.fn.__qualname__}",
            signature=dict(signature),
            constexprs=dict(constexprs),
            attrs={k: v for k, v in attrs.items() if v},
            options=launch_options,
        )
        spec = self.specs.setdefault(spec.key(), spec)
        if self.current_source and self.current_source not in spec.sources:
            spec.sources.append(self.current_source)


def _compilation_knobs():
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - triton < 3.4
        return None
    return knobs.compilation


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchRecorder]:
    """While active, Triton launches are recorded (not run) and the process looks like one H100."""
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("kiln.tune.aot: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    recorder = LaunchRecorder()

    def run(self, *args, grid, warmup, **kwargs):
        recorder.record(self, args, kwargs)
        return None

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(JITFunction, "run", run))
        for patch in _h100_patches():
            stack.enter_context(patch)
        yield recorder


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _h100_patches() -> list:
    """Launchers ask the device for its SM count, its capability (the TMA choice) and its name (the
    tuning cache key); answer as an H100 would, in every kiln module that imported those helpers."""
    import kiln.ops  # noqa: F401  (every launcher module imported, so the loop below sees them)
    from kiln.ops import tuned_configs as cache
    from kiln.ops.gemm import tiling
    from kiln.ops.gemm.linear import triton_tma

    def tma_device(device=None) -> bool:
        return triton_tma.descriptors_available()

    replacements = {
        id(tiling.num_sms): lambda device: H100_SMS,
        id(triton_tma.tma_device): tma_device,
        id(cache.device_name): lambda device=None: H100_NAME,
    }
    patches = [_env("KILN_GEMM_TMA", os.environ.get("KILN_GEMM_TMA", "1"))]
    for module in [m for name, m in sys.modules.items() if name.startswith("kiln.") and m is not None]:
        for attr, value in list(vars(module).items()):
            if id(value) in replacements:
                patches.append(_patched(module, attr, replacements[id(value)]))
    return patches


@dataclass
class CompileResult:
    """What building one `LaunchSpec` for sm_90 gave: error text (None = compiled), spill bytes
    (cubin STACK; -1 when cuobjdump is missing), registers per thread, shared memory bytes."""

    spec: LaunchSpec
    error: str | None = None
    spill_bytes: int = -1
    registers: int = -1
    shared_bytes: int = 0

    @property
    def hot_spill(self) -> bool:
        """Spills in a 16/8-bit launch that a real shape makes (a bench or model shape, not only
        fuzz shapes): the GPU's hot path. fp32 launches (IEEE dots) are reported, not counted."""
        real_shape = (
            any(not source.endswith("[fuzz]") for source in self.spec.sources) or not self.spec.sources
        )
        return self.spill_bytes > 0 and self.spec.operand_type() != "fp32" and real_shape

    def as_dict(self) -> dict:
        return {
            "kernel": self.spec.kernel,
            "signature": self.spec.signature,
            "operand": self.spec.operand_type(),
            "constexprs": self.spec.constexpr_summary(),
            "attrs": {str(k): v for k, v in self.spec.attrs.items()},
            "sources": self.spec.sources,
            "ok": self.error is None,
            "error": self.error,
            "spill_bytes": self.spill_bytes,
            "hot_spill": self.hot_spill,
            "registers": self.registers,
            "shared_bytes": self.shared_bytes,
        }


def compile_spec(spec: LaunchSpec) -> CompileResult:
    """Compile one recorded launch for sm_90 with the installed Triton; never raises for a kernel
    that fails to build (the error text is in the result)."""
    import triton
    from triton.compiler import ASTSource

    source = ASTSource(fn=spec.fn, signature=spec.signature, constexprs=spec.constexprs, attrs=spec.attrs)
    try:
        kernel = triton.compile(source, target=sm90_target(), options=dict(spec.options))
    except Exception as exc:  # the compile failure is the finding
        text = f"{type(exc).__name__}: {exc}"
        return CompileResult(spec, error=text[-4000:])
    result = CompileResult(spec, shared_bytes=int(kernel.metadata.shared))
    if result.shared_bytes > H100_SHARED_BYTES:
        result.error = f"needs {result.shared_bytes} bytes of shared memory (H100: {H100_SHARED_BYTES})"
    usage = _resource_usage(kernel.asm["cubin"])
    result.spill_bytes, result.registers = usage.get("STACK", -1), usage.get("REG", -1)
    return result


def _resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage: dict[str, int] = {}
    for token in text.split():
        name, _, value = token.partition(":")
        if value.isdigit():
            usage[name] = max(usage.get(name, 0), int(value))
    return usage
