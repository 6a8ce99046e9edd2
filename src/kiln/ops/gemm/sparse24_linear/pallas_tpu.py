"""sparse24_linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU): the kept values and
the 2-bit positions cross HBM as they are stored and the 2:4 weight is expanded in VMEM.

Layout (kiln.quant.sparse24): values column c = 2g + j is kept value j of group g; its position lies in
2-bit field c % 4 of meta byte c // 4 (byte b holds groups 2b and 2b + 1, two fields each), so meta is
one byte per four values columns. Elementwise work on the TPU needs both on the same lanes, and lane
interleaving (a strided or repeating lane shuffle) is what Mosaic does badly, so the kernel widens the
meta tile [block_n, block_v / 4] to one byte per values column with a 0/1 matrix on the MXU (exact:
bytes are at most 255, bf16 holds them, one non-zero term per sum).

Then it works in position planes: plane p of the weight tile keeps values[n, c] where its position is
p and 0 elsewhere, and multiplies x's column 4 (c // 2) + p. The wrapper hands x over with each K
tile's four planes side by side (column c's group repeated for both kept values, so x is twice as
wide), and each grid step does 4 dots into a float32 VMEM accumulator: twice a dense GEMM's MACs,
which the MXU has spare where this kernel pays (decode, bound by the weight bytes). The bias
(float32) is added on the last K step before the one rounding to x's dtype.

Grid (M / block_m, N / block_n, K/2 / block_v), K innermost ("arbitrary"). block_v is 512 values
columns (meta blocks of 128 lanes) when K needs more than one step, else the whole of K/2 rounded up
to 128 (the meta block is then the whole padded meta). M, N, K zero-padded (padded values are 0,
whatever position their zero meta names), the result sliced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR
from kiln.ops.pallas_common import (
    LANES,
    pad_to,
    round_up,
    store_on_last_k,
    sublanes,
    tpu_interpret,
    tpu_params,
    zero_on_first_k,
)

POSITIONS = 4  # a group of four dense columns, so four position planes
VALUES_PER_BYTE = 4  # kept values whose 2-bit positions share one meta byte
MAX_BLOCK_V = VALUES_PER_BYTE * LANES  # values columns per K step: meta blocks of 128 lanes


def _kernel(x_ref, v_ref, m_ref, widen_ref, *refs, has_bias: bool, block_v: int, precision):
    bias_ref = refs[0] if has_bias else None
    o_ref, acc_ref = refs[-2], refs[-1]
    zero_on_first_k(acc_ref)

    meta = m_ref[...].astype(jnp.int32).astype(jnp.float32).astype(jnp.bfloat16)
    byte_of_value = jax.lax.dot(meta, widen_ref[...], preferred_element_type=jnp.float32).astype(jnp.int32)
    field = jax.lax.broadcasted_iota(jnp.int32, byte_of_value.shape, 1) & (VALUES_PER_BYTE - 1)
    position = (byte_of_value >> (2 * field)) & (POSITIONS - 1)
    values = v_ref[...].astype(jnp.float32)
    acc = acc_ref[...]
    for p in range(POSITIONS):
        w = jnp.where(position == p, values, 0.0).astype(x_ref.dtype)
        acc += dot_weight_rows(x_ref[:, p * block_v : (p + 1) * block_v], w, precision)
    acc_ref[...] = acc

    store_on_last_k(acc_ref, o_ref, bias_ref)


def sparse24_blocks(m: int, n: int, k: int, dtype) -> tuple[int, int, int]:
    """(block_m, block_n, block_v): sublane-multiple rows, 128-lane columns, block_v values columns
    (K / 2 in one step when it fits in MAX_BLOCK_V, else MAX_BLOCK_V per step)."""
    half = k // 2
    block_v = round_up(half, LANES) if half <= MAX_BLOCK_V else MAX_BLOCK_V
    return min(256, round_up(m, max(sublanes(dtype), 16))), min(256, round_up(n, LANES)), block_v


def position_planes(x2, block_v: int, cols: int):
    """x [M, K] -> [M, 4 * cols]: per K tile of block_v values columns, plane p holds, at column c,
    x[:, 4 (c // 2) + p] (the dense column that values column c fills if its position is p)."""
    m = x2.shape[0]
    groups = pad_to(x2, 1, 2 * cols).reshape(m, cols // 2, POSITIONS)
    per_value = jnp.repeat(groups, 2, axis=1)  # [M, cols, 4]: both kept values see their group
    tiles = per_value.reshape(m, cols // block_v, block_v, POSITIONS)
    return jnp.swapaxes(tiles, 2, 3).reshape(m, POSITIONS * cols)


def widening_matrix(block_v: int):
    """bf16 [block_v / 4, block_v] 0/1: meta byte b to the four values columns 4b .. 4b + 3 it covers."""
    bytes_ = jnp.arange(block_v // VALUES_PER_BYTE)[:, None]
    return (jnp.arange(block_v)[None, :] // VALUES_PER_BYTE == bytes_).astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def sparse24_gemm_tpu(x2, values, meta, bias, blocks, interpret):
    """x [M, K] @ W^T (+ bias) with W the 2:4 weight (values [N, K/2], meta uint8 [N, ceil(K/8)])
    -> [M, N] in x's dtype."""
    (m, k), n = x2.shape, values.shape[0]
    block_m, block_n, block_v = blocks or sparse24_blocks(m, n, k, x2.dtype)
    block_b = block_v // VALUES_PER_BYTE
    mp, np_, cols = round_up(m, block_m), round_up(n, block_n), round_up(k // 2, block_v)
    operands = [
        pad_to(position_planes(x2, block_v, cols), 0, mp),
        pad_to(pad_to(values, 0, np_), 1, cols),
        pad_to(pad_to(meta, 0, np_), 1, cols // VALUES_PER_BYTE),
        widening_matrix(block_v),
    ]
    in_specs = [
        pl.BlockSpec((block_m, POSITIONS * block_v), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((block_n, block_v), lambda i, j, kk: (j, kk)),
        pl.BlockSpec((block_n, block_b), lambda i, j, kk: (j, kk)),
        pl.BlockSpec((block_b, block_v), lambda i, j, kk: (0, 0)),
    ]
    if bias is not None:
        operands.append(pad_to(bias.astype(jnp.float32).reshape(1, n), 1, np_))
        in_specs.append(pl.BlockSpec((1, block_n), lambda i, j, kk: (0, j)))
    kernel = functools.partial(
        _kernel, has_bias=bias is not None, block_v=block_v, precision=gemm_precision(x2.dtype)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), x2.dtype),
        grid=(mp // block_m, np_ // block_n, cols // block_v),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def sparse24_linear_pallas_tpu(x, values, meta, bias=None, *, blocks=None, interpret=None):
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W the 2:4 weight (spec.py) expanded in VMEM.
    `blocks` (block_m, block_n, block_v) overrides the heuristic; block_v a multiple of 512 when K / 2
    needs more than one step (the meta block must then be 128-lane aligned)."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2):
        return sparse24_gemm_tpu(x2, values, meta, bias, blocks, interpret)

    return over_rows(kernel, x, values.shape[0], bias)


SPARSE24_LINEAR.register_jax("pallas_tpu", sparse24_linear_pallas_tpu)
