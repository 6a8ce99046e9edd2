"""gguf_linear as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): the weight is read as
the file's raw GGUF blocks and decoded in registers by ../gguf_pallas_gpu.py (every block format of
the spec), never written to memory as floats.

Grid (M / BLOCK_M, N / BLOCK_N); each program loops over K in BLOCK_K steps (a power of two dividing
K: whole 32-blocks, or part of a 256-weight super-block): it decodes its [BLOCK_N, BLOCK_K] weight
tile to float32, rounds it to x's dtype (as xla.py rounds the decoded weight) and accumulates
x[:, k-slice] @ tile^T in float32 registers (fp32 x at HIGHEST precision, as linear's GEMMs). The
bias is added in float32 and the result rounded once. x and the bias are zero-padded to whole blocks
and the result sliced; the weight is not copied: rows past N are clamped for the loads (their outputs
are sliced off). float64 x, which the kernel does not compute, runs xla.py's path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR
from kiln.ops.gemm.gguf_linear.xla import gguf_linear_xla
from kiln.ops.gemm.gguf_pallas_gpu import decode_weights, tile_k
from kiln.ops.gemm.linear.xla import dot_weight_rows, gemm_precision, over_rows
from kiln.ops.pallas_common import gpu_interpret, gpu_output_tiles_call, pad_to, round_up
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

KERNEL_DTYPES = tuple(jnp.dtype(t) for t in ("float32", "float16", "bfloat16"))
MAX_BLOCK_K = 64  # weights decoded per step and row: a [BLOCK_N, 64] tile of gathers in registers


def _kernel(x_ref, w_ref, *refs, qtype: str, block_n: int, block_k: int, num_k: int, has_bias: bool):
    bias_ref = refs[0] if has_bias else None
    o_ref = refs[-1]
    rows = pl.program_id(1) * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)
    rows = jnp.minimum(rows, w_ref.shape[0] - 1)
    precision = gemm_precision(x_ref.dtype)

    def body(kk, acc):
        start = pl.multiple_of(kk * block_k, block_k)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
        w = decode_weights(w_ref, rows, cols, qtype).astype(x_ref.dtype)
        return acc + dot_weight_rows(x_ref[:, pl.ds(start, block_k)], w, precision)

    acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros(o_ref.shape, jnp.float32))
    if has_bias:
        acc = acc + bias_ref[...][None, :].astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("qtype", "blocks", "interpret"))
def gguf_gemm_gpu(x2, qweight, qtype: str, bias, blocks, interpret):
    """x [M, K] @ decode(qweight [N, row_bytes])^T (+ bias [N]) -> [M, N] in x's dtype."""

    (m, k), n = x2.shape, qweight.shape[0]
    block_m, block_n, block_k = blocks or (
        min(64, max(16, pl.next_power_of_2(m))),
        min(64, max(16, pl.next_power_of_2(n))),
        tile_k(qtype, k, MAX_BLOCK_K),
    )
    operands = [pad_to(x2, 0, round_up(m, block_m)), qweight]
    # x's row panel (the kernel loads block_k slices of it); the whole weight, gathered from.
    in_specs = [pl.BlockSpec((block_m, k), lambda i, j: (i, 0)), pl.no_block_spec]
    kernel = functools.partial(
        _kernel, qtype=qtype, block_n=block_n, block_k=block_k, num_k=k // block_k, has_bias=bias is not None
    )
    return gpu_output_tiles_call(
        kernel, operands, in_specs, x2.dtype, m, n, block_m, block_n, bias=bias, num_stages=2,
        interpret=interpret,
    )  # fmt: skip


def gguf_linear_pallas_gpu(x, qweight, qtype, bias=None, *, blocks=None, interpret=None):
    """x [..., K] @ W^T (+ bias) with W the GGUF `qtype` blocks uint8 [N, row_bytes] (spec.py), decoded
    in registers. `blocks` (block_m, block_n, block_k) overrides the heuristic: powers of two, block_m
    and block_n >= 16, block_k dividing K."""
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        return gguf_linear_xla(x, qweight, qtype, bias)
    interpret = gpu_interpret() if interpret is None else interpret
    k = qweight.shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    if blocks is not None and (any(b < 16 or b & (b - 1) for b in blocks) or k % blocks[2]):
        raise ValueError(
            f"gguf_linear: blocks={blocks}, expected powers of two >= 16 with block_k dividing K={k}"
        )

    def kernel(x2):
        return gguf_gemm_gpu(x2, qweight, qtype, bias, blocks, interpret)

    return over_rows(kernel, x, qweight.shape[0], bias)


GGUF_LINEAR.register_jax("pallas_gpu", gguf_linear_pallas_gpu)
