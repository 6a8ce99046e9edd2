"""sparse24_linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the kept values
and the 2-bit positions are read as they are stored and the 2:4 weight is expanded in registers.

Layout (kiln.quant.sparse24): dense column k lies in group g = k // 4 at position p = k % 4; the
group's kept values are values columns 2g and 2g + 1, their positions the 2-bit fields 2 (g % 2) and
2 (g % 2) + 1 of meta byte g // 2. So weight [n, k] = sum over j of (values[n, 2g + j] where field j
names p, else 0): exact in x's dtype (one non-zero term for a valid group), as jax_codecs'
decompress_24 sums its hits.

Grid (M / BLOCK_M, N / BLOCK_N); each program loops over dense K in BLOCK_K steps, gathers its
[BLOCK_N, BLOCK_K] tile's meta byte and two candidate values per element (Triton loads through
pointer tensors; a tile's values and meta sit in a few cache lines per row), expands it and
accumulates x[:, k-slice] @ tile^T in float32 (fp32 x at HIGHEST precision). The bias is added in
float32, then one rounding to x's dtype. x and the bias are zero-padded to whole blocks (K too:
columns past K are zeroed in the tile) and the result sliced; the weight is not copied: rows past N
are clamped for the loads and their outputs sliced off.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.gemm.sparse24_linear.spec import SPARSE24_LINEAR
from kiln.ops.pallas_common import gpu_interpret, gpu_output_tiles_call, pad_to, round_up


def _expand_tile(v_ref, m_ref, rows, cols, k: int):
    """float32 [BN, BK] dense weight at rows int32 [BN, 1] (in range) and dense columns int32 [1, BK]
    (0 at columns >= K)."""
    shape = (rows.shape[0], cols.shape[1])
    rows = jnp.broadcast_to(rows, shape)
    group = jnp.broadcast_to(jnp.minimum(cols, k - 1) >> 2, shape)  # clamped: loads stay in range
    byte = m_ref[rows, group >> 1].astype(jnp.int32) >> (4 * (group & 1))  # this group's two fields
    position = jnp.broadcast_to(cols & 3, shape)
    w = jnp.zeros(shape, jnp.float32)
    for j in range(2):
        kept = v_ref[rows, 2 * group + j].astype(jnp.float32)
        w = w + jnp.where(((byte >> (2 * j)) & 3) == position, kept, 0.0)
    return jnp.where(jnp.broadcast_to(cols < k, shape), w, 0.0)


def _kernel(x_ref, v_ref, m_ref, *refs, block_n: int, block_k: int, num_k: int, k: int, has_bias: bool):
    bias_ref = refs[0] if has_bias else None
    o_ref = refs[-1]
    rows = pl.program_id(1) * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)
    rows = jnp.minimum(rows, v_ref.shape[0] - 1)
    precision = gemm_precision(x_ref.dtype)

    def body(kk, acc):
        start = pl.multiple_of(kk * block_k, block_k)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        w = _expand_tile(v_ref, m_ref, rows, cols, k).astype(x_ref.dtype)
        return acc + dot_weight_rows(x_ref[:, pl.ds(start, block_k)], w, precision)

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    if has_bias:
        acc = acc + bias_ref[...][None, :].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def sparse24_gemm_gpu(x2, values, meta, bias, blocks, interpret):
    """x [M, K] @ W^T (+ bias) with W the 2:4 weight (values [N, K/2], meta uint8 [N, ceil(K/8)])
    -> [M, N] in x's dtype."""

    (m, k), n = x2.shape, values.shape[0]
    block_m, block_n, block_k = blocks or (
        min(64, max(16, pl.next_power_of_2(m))),
        min(64, max(16, pl.next_power_of_2(n))),
        min(64, max(16, pl.next_power_of_2(k))),
    )
    kp = round_up(k, block_k)
    operands = [pad_to(pad_to(x2, 0, round_up(m, block_m)), 1, kp), values, meta]
    # x's row panel (the kernel loads block_k slices of it); values and meta whole, gathered from.
    in_specs = [pl.BlockSpec((block_m, kp), lambda i, j: (i, 0)), pl.no_block_spec, pl.no_block_spec]
    kernel = functools.partial(
        _kernel, block_n=block_n, block_k=block_k, num_k=kp // block_k, k=k, has_bias=bias is not None
    )
    return gpu_output_tiles_call(
        kernel, operands, in_specs, x2.dtype, m, n, block_m, block_n, bias=bias, num_stages=2,
        interpret=interpret,
    )  # fmt: skip


def sparse24_linear_pallas_gpu(x, values, meta, bias=None, *, blocks=None, interpret=None):
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W the 2:4 weight (spec.py) expanded in
    registers. `blocks` (block_m, block_n, block_k) overrides the heuristic (powers of two >= 16)."""
    if blocks is not None and any(b < 16 or b & (b - 1) for b in blocks):
        raise ValueError(f"sparse24_linear: blocks={blocks}, expected powers of two >= 16")
    interpret = gpu_interpret() if interpret is None else interpret

    def kernel(x2):
        return sparse24_gemm_gpu(x2, values, meta, bias, blocks, interpret)

    return over_rows(kernel, x, values.shape[0], bias)


SPARSE24_LINEAR.register_jax("pallas_gpu", sparse24_linear_pallas_gpu)
