"""fp8_block_linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the quantized
GEMMs' tile loop (../scaled_pallas_gpu.py) with the activation quantization fused in.

One K step is one group of block_k inputs (block_k is a power of two, 16..256: a legal Triton tile and
dot depth). The step loads the float x tile [block_m, block_k], quantizes it per row to e4m3 with
xla.py's quantize_groups (the same float32 scale and rounding as the XLA path; compiled, its
divisions are PTX's div.rn.f32, as the Triton kernel's), multiplies it with the
e4m3 weight tile, both widened to bfloat16 in registers (exact), with a float32 result, and
accumulates it scaled:

    acc[m, n] += (x_q[m, g] . w[n, g]) * x_scale[m, g] * w_scale[n // block_n, g]

The weight scales come in as a [G, N] table, one row per group and one column per output feature
(expanded from one per block_n rows by the wrapper, so block_n need not divide the tile); a step
loads its group's [1, block_n] row. The epilogue adds the bias. K is zero-padded to whole groups (zero
x and w add nothing), M and N by the tile loop.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.fp8_block_linear.spec import FP8_BLOCK_LINEAR
from kiln.ops.gemm.fp8_block_linear.xla import quantize_groups
from kiln.ops.gemm.int8_linear.pallas_tpu import empty_or
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.gemm.scaled_pallas_gpu import (
    CONTRACT_LAST,
    Operand,
    check_tiles,
    tiled_gemm_gpu,
    w_panel,
    x_panel,
)
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up


def _step(kk, acc, x_ref, w_ref, ws_ref, *_, block_k: int, compiled: str | None):
    start = pl.multiple_of(kk * block_k, block_k)
    x_tile = x_ref[:, pl.ds(start, block_k)]
    x_q, x_scale = quantize_groups(x_tile, block_k, compiled=compiled)  # [bm, bk] e4m3, [bm, 1]
    w = w_ref[:, pl.ds(start, block_k)]
    part = jax.lax.dot_general(
        x_q.astype(jnp.bfloat16), w.astype(jnp.bfloat16), CONTRACT_LAST, preferred_element_type=jnp.float32
    )
    return acc + part * x_scale * ws_ref[pl.ds(kk, 1), :]


def _epilogue(acc, x_ref, w_ref, ws_ref, *bias_ref):
    return acc + bias_ref[0][...][None, :] if bias_ref else acc


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "out_dtype", "tiles", "interpret"))
def block_fp8_gemm_gpu(x, w_fp8, w_scale, bias, block_n, block_k, out_dtype, tiles, interpret):
    """x [M, K] float (quantized in the kernel per token and group) times w_fp8 [N, K] e4m3 with
    w_scale [ceil(N/block_n), ceil(K/block_k)] float32 (+ bias [N]) -> [M, N] in out_dtype."""
    (m, k), n = x.shape, w_fp8.shape[0]
    kp = round_up(k, block_k)
    ws = jnp.repeat(w_scale.astype(jnp.float32), block_n, axis=0)[:n].T  # [G, N]: one column per feature
    operands = [x_panel(pad_to(x, 1, kp)), w_panel(pad_to(w_fp8, 1, kp)), Operand(ws, (None, "n"))]
    if bias is not None:
        operands.append(w_panel(bias.astype(jnp.float32)))
    return tiled_gemm_gpu(
        functools.partial(_step, block_k=block_k, compiled=None if interpret else "triton"),
        _epilogue,
        operands,
        m=m,
        n=n,
        num_k=kp // block_k,
        acc_dtype=jnp.float32,
        out_dtype=out_dtype,
        tiles=tiles,
        interpret=interpret,
    )


def fp8_block_linear_pallas_gpu(
    x, w_fp8, w_scale, block_n, block_k, bias=None, out_dtype=jnp.bfloat16, *, tiles=None, interpret=None
):
    """y = dequant(x_q) @ dequant(w_fp8)^T (+ bias) -> [M, N] in out_dtype; shapes: spec.py. `tiles`
    (block_m, block_n) overrides the default output tile."""
    interpret = gpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(out_dtype)
    tiles = check_tiles("fp8_block_linear", tiles)

    def kernel():
        return block_fp8_gemm_gpu(
            x, w_fp8, w_scale, bias, int(block_n), int(block_k), out_dtype, tiles, interpret
        )

    return empty_or(kernel, x, w_fp8, bias, out_dtype)


FP8_BLOCK_LINEAR.register_jax("pallas_gpu", fp8_block_linear_pallas_gpu)
