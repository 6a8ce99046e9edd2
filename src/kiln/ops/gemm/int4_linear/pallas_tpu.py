"""int4_linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU): the packed int32 words
cross HBM as they are and are unpacked and dequantized in VMEM.

A word j holds weights 8j .. 8j + 7 (nibble i = weight 8j + i). Lane-dim interleaving is costly on
the TPU, so instead of spreading a word's nibbles along K the kernel works in nibble planes: plane i
of a [block_n, block_w] word tile is (w >> 4i) & 15, the weights 8j + i, and x's columns are permuted
by the wrapper (per K tile of 8 * block_w columns) so that x's plane i is the contiguous column slice
[i * block_w, (i + 1) * block_w). Each grid step then does 8 dots x_plane_i @ deq(plane_i)^T into a
float32 VMEM accumulator, deq(q) = (q - zero) * scale in float32 rounded to x's dtype (as the spec's
reference). The 8 weights of a word always share a group (group_size is a multiple of 8), so the
wrapper hands over the scale and zero point per word ([N, words] float32): simple, but it adds 8 bytes
per 8 weights of HBM traffic to the packed 4; expanding the [N, G] tables inside the kernel would cut
that. Grid (M / block_m, N / block_n, words / block_w), the word axis innermost ("arbitrary").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR
from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.pallas_common import LANES, pad_to, round_up, sublanes, tpu_interpret, tpu_params

NIBBLES = 8


def _kernel(x_ref, w_ref, s_ref, z_ref, o_ref, acc_ref, *, block_w: int, precision):
    @pl.when(pl.program_id(2) == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    words, scale, zero = w_ref[...], s_ref[...], z_ref[...]
    acc = acc_ref[...]
    for i in range(NIBBLES):
        q = ((words >> (4 * i)) & 0xF).astype(jnp.float32)
        w = ((q - zero) * scale).astype(x_ref.dtype)
        acc += dot_weight_rows(x_ref[:, i * block_w : (i + 1) * block_w], w, precision)
    acc_ref[...] = acc

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def per_word(table, group_size: int, words: int):
    """[N, G] per-group values -> float32 [N, words]: the value of the group each word lies in."""
    group_of_word = jnp.minimum(jnp.arange(words) * NIBBLES // group_size, table.shape[1] - 1)
    return table.astype(jnp.float32)[:, group_of_word]


def nibble_planes(x2, block_w: int, words: int):
    """x [M, K] -> [M, words * 8], each K tile of 8 * block_w columns reordered plane by plane."""
    m = x2.shape[0]
    x = pad_to(x2, 1, words * NIBBLES).reshape(m, words // block_w, block_w, NIBBLES)
    return jnp.swapaxes(x, 2, 3).reshape(m, words * NIBBLES)


@functools.partial(jax.jit, static_argnames=("group_size", "blocks", "interpret"))
def int4_gemm_tpu(x2, qweight, scales, zeros, group_size: int, blocks, interpret):
    """x [M, K] @ dequantized W^T -> [M, N] in x's dtype."""
    m, (n, words) = x2.shape[0], qweight.shape
    block_m, block_n, block_w = blocks or (
        min(256, round_up(m, max(sublanes(x2.dtype), 16))),
        min(256, round_up(n, LANES)),
        LANES,
    )
    mp, np_, wp = round_up(m, block_m), round_up(n, block_n), round_up(words, block_w)
    x = pad_to(nibble_planes(x2, block_w, wp), 0, mp)
    tables = [pad_to(pad_to(per_word(t, group_size, words), 0, np_), 1, wp) for t in (scales, zeros)]
    weight_spec = pl.BlockSpec((block_n, block_w), lambda i, j, kk: (j, kk))
    out = pl.pallas_call(
        functools.partial(_kernel, block_w=block_w, precision=gemm_precision(x2.dtype)),
        out_shape=jax.ShapeDtypeStruct((mp, np_), x2.dtype),
        grid=(mp // block_m, np_ // block_n, wp // block_w),
        in_specs=[pl.BlockSpec((block_m, NIBBLES * block_w), lambda i, j, kk: (i, kk))] + [weight_spec] * 3,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((block_m, block_n), jnp.float32)],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(x, pad_to(pad_to(qweight, 0, np_), 1, wp), *tables)
    return out[:m, :n]


def int4_linear_pallas_tpu(x, qweight, scales, zeros, group_size, *, blocks=None, interpret=None):
    """x [..., K] @ W^T with W the group-wise int4 weight (spec.py), dequantized in VMEM."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2):
        return int4_gemm_tpu(x2, qweight, scales, zeros, group_size, blocks, interpret)

    return over_rows(kernel, x, qweight.shape[0], None)


INT4_LINEAR.register_jax("pallas_tpu", int4_linear_pallas_tpu)
