"""The tile loop the Pallas Triton (GPU) kernels of the quantized GEMMs share (int8_linear,
fp8_linear, fp8_block_linear, int4_linear); each op's pallas_gpu.py brings its K-step tile loader and
its epilogue.

Grid (M / block_m, N / block_n): a program owns one [block_m, block_n] output tile and walks K in
`num_k` steps (fori_loop) with a register accumulator (float32, or int32 for int8 x int8). Every
operand is tiled along M, along N or not at all, per dim (`Operand.tiled`): x-side panels are
[block_m, whole K], weight-side panels [block_n, whole K], scale vectors [block_m] or [block_n]. The
refs are pointers; `step(kk, acc, *refs)` loads its own K slices (pl.ds with power-of-two sizes:
Triton's rule, which the lowering checks on every load and store) and returns the new accumulator;
`epilogue(acc, *refs)` returns the float32 tile that is rounded once to out_dtype. Blocks are powers
of two, at least 16 (Triton's dot); M and N are zero-padded to them here, K by the op's wrapper (it
knows its step), and the result sliced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, round_up

CONTRACT_LAST = (((1,), (1,)), ((), ()))  # x [m, k] . w [n, k] -> [m, n]: no transposed copy


@dataclass(frozen=True)
class Operand:
    """An input of the kernel and, per dim, the grid axis that tiles it: "m" (block_m rows), "n"
    (block_n rows) or None (whole dim)."""

    array: jax.Array
    tiled: tuple[str | None, ...]


def x_panel(array) -> Operand:
    """[M, ...] x-side data: block_m rows, the rest whole."""
    return Operand(array, ("m",) + (None,) * (array.ndim - 1))


def w_panel(array) -> Operand:
    """[N, ...] weight-side data: block_n rows, the rest whole."""
    return Operand(array, ("n",) + (None,) * (array.ndim - 1))


def default_tiles(m: int, n: int) -> tuple[int, int]:
    """(block_m, block_n): powers of two, 16 (the smallest Triton dot) to 64 x 128."""
    return min(64, max(16, pl.next_power_of_2(m))), min(128, max(16, pl.next_power_of_2(n)))


def _block_spec(operand: Operand, block_m: int, block_n: int):
    size = {"m": block_m, "n": block_n}
    block = tuple(size.get(axis, dim) for axis, dim in zip(operand.tiled, operand.array.shape, strict=True))

    def index_map(i, j):
        return tuple({"m": i, "n": j}.get(axis, 0) for axis in operand.tiled)

    return pl.BlockSpec(block, index_map)


def _pad_tiled(operand: Operand, mp: int, np_: int):
    array = operand.array
    for axis, tiled in enumerate(operand.tiled):
        if tiled is not None:
            array = pad_to(array, axis, {"m": mp, "n": np_}[tiled])
    return array


def _kernel(*refs, step, epilogue, num_k: int, acc_dtype):
    *in_refs, o_ref = refs
    acc = jax.lax.fori_loop(
        0, num_k, lambda kk, acc: step(kk, acc, *in_refs), jnp.zeros(o_ref.shape, acc_dtype)
    )
    o_ref[...] = epilogue(acc, *in_refs).astype(o_ref.dtype)


def tiled_gemm_gpu(
    step: Callable,
    epilogue: Callable,
    operands: list[Operand],
    *,
    m: int,
    n: int,
    num_k: int,
    acc_dtype,
    out_dtype,
    tiles: tuple[int, int] | None,
    interpret,
    num_warps: int = 4,
    num_stages: int = 3,
):
    """Run the tile loop of the module docstring -> [m, n] in out_dtype. `tiles` (block_m, block_n)
    overrides default_tiles; `step` and `epilogue` see the refs in `operands` order."""
    from jax.experimental.pallas import triton as plgpu

    block_m, block_n = tiles or default_tiles(m, n)
    mp, np_ = round_up(m, block_m), round_up(n, block_n)
    out = pl.pallas_call(
        functools.partial(_kernel, step=step, epilogue=epilogue, num_k=num_k, acc_dtype=acc_dtype),
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=(mp // block_m, np_ // block_n),
        in_specs=[_block_spec(operand, block_m, block_n) for operand in operands],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
    )(*[_pad_tiled(operand, mp, np_) for operand in operands])
    return out[:m, :n]


def check_tiles(op: str, tiles) -> tuple[int, int] | None:
    """`tiles` as a tuple (hashable: a jit static argument), or None; ValueError unless it is None or
    two powers of two >= 16 (Triton's dot)."""
    if tiles is None:
        return None
    if len(tiles) != 2 or any(t < 16 or t & (t - 1) for t in tiles):
        raise ValueError(f"{op}: tiles {tuple(tiles)}, expected (block_m, block_n), powers of two >= 16")
    return tuple(tiles)
