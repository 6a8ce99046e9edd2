"""Which Pallas/XLA implementation runs, and how: compiled on the matching accelerator, or through
Pallas's interpreter on the CPU (the TPU interpreter for `pallas_tpu`, the plain one for `pallas_gpu`).

Also the padding helpers every Mosaic (TPU) wrapper needs: a block's last two dims must be multiples
of (sublane, 128) or the whole array dim, so wrappers pad to a tile multiple and slice the result.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

IMPLEMENTATIONS = ("pallas_tpu", "pallas_gpu", "xla")
LANES = 128

# Extra InterpretParams fields for the TPU interpreter (tests turn on race detection with this).
_tpu_interpret_options: contextvars.ContextVar[tuple] = contextvars.ContextVar("kiln_tpu_interp", default=())
# True inside `compile_for_gpu()` / `compile_for_tpu()`: the kernels lower for real off the device.
_gpu_compile: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_gpu_compile", default=False)
_tpu_compile: contextvars.ContextVar[bool] = contextvars.ContextVar("kiln_tpu_compile", default=False)


def default_implementation() -> str:
    """pallas_tpu on a TPU, pallas_gpu on a GPU, xla on the CPU."""
    backend = jax.default_backend()
    by_platform = {"tpu": "pallas_tpu", "gpu": "pallas_gpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu"}
    return by_platform.get(backend, "xla")


def resolve(op: str, implementation: str | None, available: tuple[str, ...] = IMPLEMENTATIONS) -> str:
    """The implementation name to run for `op` (ValueError naming the choices if unknown). `available`
    lists the ones the op has; with None, an op lacking this device's kernel falls back to xla."""
    if implementation is None:
        default = default_implementation()
        return default if default in available else "xla"
    if implementation not in available:
        raise ValueError(
            f"{op}: unknown implementation {implementation!r}; expected one of {', '.join(available)} or None"
        )
    return implementation


def on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


@contextlib.contextmanager
def tpu_interpreter(**options) -> Iterator[None]:
    """Within this block, TPU-interpreted kernels run with these `pltpu.InterpretParams` fields
    (for example `detect_races=True`)."""
    token = _tpu_interpret_options.set(tuple(sorted(options.items())))
    try:
        yield
    finally:
        _tpu_interpret_options.reset(token)


def tpu_interpret():
    """`interpret=` for a Mosaic kernel: False on a TPU or inside `compile_for_tpu()`, else the TPU
    interpreter. Uninitialized memory reads as NaN there, so a block the kernel forgets to write fails
    verification."""
    if on_tpu() or _tpu_compile.get():
        return False
    return pltpu.InterpretParams(**dict(_tpu_interpret_options.get()))


@contextlib.contextmanager
def compile_for_tpu() -> Iterator[None]:
    """Within this block Mosaic kernels are not interpreted, so `jax.export(..., platforms=["tpu"])`
    lowers them to Mosaic MLIR on a machine without a TPU (a lowering check)."""
    token = _tpu_compile.set(True)
    try:
        yield
    finally:
        _tpu_compile.reset(token)


def gpu_interpret() -> bool:
    """`interpret=` for a Pallas Triton kernel: False on a GPU or inside `compile_for_gpu()`, else the
    plain Pallas interpreter."""
    return not (on_gpu() or _gpu_compile.get())


@contextlib.contextmanager
def compile_for_gpu() -> Iterator[None]:
    """Within this block Pallas Triton kernels are not interpreted, so `jax.export(...,
    platforms=["cuda"])` lowers them to Triton IR on a machine without a GPU (a lowering check)."""
    token = _gpu_compile.set(True)
    try:
        yield
    finally:
        _gpu_compile.reset(token)


def tpu_params(*semantics: str):
    """Mosaic compiler params with per-grid-axis semantics ("parallel" / "arbitrary")."""
    return pltpu.CompilerParams(dimension_semantics=tuple(semantics))


def squeezed():
    """A block dim of size 1 that the kernel does not see (pl.Squeezed on newer JAX, None on older)."""
    return pl.Squeezed() if hasattr(pl, "Squeezed") else None


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def sublanes(dtype) -> int:
    """Rows per native TPU tile: 8 for 32-bit types, 16 for 16-bit, 32 for 8-bit (packed sublanes)."""
    return {4: 8, 2: 16, 1: 32}.get(jnp.dtype(dtype).itemsize, 8)


def pad_to(x: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad `axis` of x up to `size` (no-op when already that size)."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def row_block(rows: int, row_bytes: int, dtype, budget_bytes: int = 2 << 20, max_rows: int = 512) -> int:
    """Rows per block for a row-wise kernel: a sublane multiple, at most `budget_bytes` per block
    (VMEM holds a few double-buffered blocks), and no more than the (rounded-up) row count."""
    sub = sublanes(dtype)
    fit = max(sub, (budget_bytes // max(row_bytes, 1)) // sub * sub)
    return min(fit, max_rows, round_up(rows, sub))


def zero_on_first_k(acc_ref, k_axis: int = 2) -> None:
    """Inside a GEMM kernel: zero the float32 accumulator scratch on the first step of the K grid axis."""

    @pl.when(pl.program_id(k_axis) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)


def store_on_last_k(acc_ref, o_ref, bias_ref=None, k_axis: int = 2) -> None:
    """Inside a GEMM kernel: on the last step of the K grid axis, write the accumulator (plus the
    float32 bias block, if any) to the output block in its dtype."""

    @pl.when(pl.program_id(k_axis) == pl.num_programs(k_axis) - 1)
    def _():
        out = acc_ref[...]
        if bias_ref is not None:
            out = out + bias_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def gpu_output_tiles_call(
    kernel, operands: list, in_specs: list, out_dtype, m: int, n: int, block_m: int, block_n: int,
    *, bias=None, num_stages: int, interpret,
):  # fmt: skip
    """A Pallas Triton GEMM over (M / block_m, N / block_n) output tiles: `kernel` writes one
    [block_m, block_n] tile of the [round_up(m), round_up(n)] output, given `operands` / `in_specs`
    (plus `bias` [n], zero-padded, as a [block_n] panel last when given); returns out[:m, :n]."""
    from jax.experimental.pallas import triton as plgpu

    mp, np_ = round_up(m, block_m), round_up(n, block_n)
    if bias is not None:
        operands = [*operands, pad_to(bias, 0, np_)]
        in_specs = [*in_specs, pl.BlockSpec((block_n,), lambda i, j: (j,))]
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // block_m, np_ // block_n),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=num_stages),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]
