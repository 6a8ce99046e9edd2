"""int4_linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the quantized GEMMs'
tile loop (../scaled_pallas_gpu.py) with the packed int32 words unpacked and dequantized in registers.

A K step covers block_k weights = block_k / 8 words, block_k a power of two that divides group_size
(16..128, so the step lies inside one group). It loads the [block_n, block_k / 8] word tile, spreads
each word's 8 nibbles along K in order (../jax_codecs.py's unpack_int4: shift, mask, reshape; nibble i
of word j is weight 8j + i, so x needs no permutation), dequantizes (q - zero) * scale in float32 with
the group's [block_n, 1] scale and zero-point columns, rounds to x's dtype (as the spec's reference)
and accumulates x_tile @ w_tile^T in float32. The scales and zero points cross HBM as [N, G] float32
tables, once per group. K is zero-padded to block_k (zero x columns make the padding nibbles count
for nothing), M and N by the tile loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.int4_linear.spec import INT4_LINEAR
from kiln.ops.gemm.jax_codecs import unpack_int4
from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.gemm.scaled_pallas_gpu import check_tiles, tiled_gemm_gpu, w_panel, x_panel
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up

NIBBLES = 8


def _step(kk, acc, x_ref, w_ref, s_ref, z_ref, *, block_k: int, group_size: int):
    start = pl.multiple_of(kk * block_k, block_k)
    x = x_ref[:, pl.ds(start, block_k)]
    words = w_ref[:, pl.ds(kk * (block_k // NIBBLES), block_k // NIBBLES)]
    group = start // group_size
    scale, zero = s_ref[:, pl.ds(group, 1)], z_ref[:, pl.ds(group, 1)]  # [block_n, 1]
    w = ((unpack_int4(words, block_k).astype(jnp.float32) - zero) * scale).astype(x.dtype)
    return acc + dot_weight_rows(x, w, gemm_precision(x.dtype))


def _epilogue(acc, *refs):
    return acc


def int4_block_k(k: int, group_size: int) -> int:
    """Weights per K step: a power of two dividing group_size, >= 16 (Triton's dot), <= 128."""
    return min(group_size, 128, max(16, pl.next_power_of_2(k)))


@functools.partial(jax.jit, static_argnames=("group_size", "tiles", "interpret"))
def int4_gemm_gpu(x2, qweight, scales, zeros, group_size: int, tiles, interpret):
    """x [M, K] @ dequantized W^T -> [M, N] in x's dtype."""
    (m, k), n = x2.shape, qweight.shape[0]
    block_k = int4_block_k(k, group_size)
    kp = round_up(k, block_k)
    operands = [
        x_panel(pad_to(x2, 1, kp)),
        w_panel(pad_to(qweight, 1, kp // NIBBLES)),
        w_panel(scales.astype(jnp.float32)),
        w_panel(zeros.astype(jnp.float32)),
    ]
    return tiled_gemm_gpu(
        functools.partial(_step, block_k=block_k, group_size=group_size),
        _epilogue,
        operands,
        m=m,
        n=n,
        num_k=kp // block_k,
        acc_dtype=jnp.float32,
        out_dtype=x2.dtype,
        tiles=tiles,
        interpret=interpret,
    )


def int4_linear_pallas_gpu(x, qweight, scales, zeros, group_size, *, tiles=None, interpret=None):
    """x [..., K] @ W^T with W the group-wise int4 weight (spec.py), dequantized in registers.
    `tiles` (block_m, block_n) overrides the default output tile."""
    interpret = gpu_interpret() if interpret is None else interpret
    tiles = check_tiles("int4_linear", tiles)

    def kernel(x2):
        return int4_gemm_gpu(x2, qweight, scales, zeros, int(group_size), tiles, interpret)

    return over_rows(kernel, x, qweight.shape[0], None)


INT4_LINEAR.register_jax("pallas_gpu", int4_linear_pallas_gpu)
