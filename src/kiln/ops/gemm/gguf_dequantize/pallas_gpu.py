"""gguf_dequantize as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU): every block format
of the spec decoded in registers from the raw GGUF bytes by ../gguf_pallas_gpu.py (float32, the jnp
decoder's operations, so float32 output is bit-exact with it and with `gguf.quants`), rounded to `dtype`.

Grid (N / BLOCK_N, K / BLOCK_K): a program decodes BLOCK_N rows x BLOCK_K weights (BLOCK_K a power of
two dividing K, so whole blocks or whole parts of one super-block) and stores them. The weight is read
where it lies (no padded copy): rows past N are clamped for the loads and masked out of the store.
Other GGML type names decode on the host through `gguf.quants` (xla.py's fallback), as the torch op does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.gemm.gguf_blocks import QTYPES
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE
from kiln.ops.gemm.gguf_dequantize.xla import gguf_dequantize_xla
from kiln.ops.gemm.gguf_pallas_gpu import decode_weights, tile_k
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.pallas_common import gpu_interpret
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

KERNEL_DTYPES = tuple(jnp.dtype(t) for t in ("float32", "float16", "bfloat16"))
MAX_BLOCK_N = 32


def _kernel(w_ref, o_ref, *, qtype: str, block_n: int, block_k: int):
    n = w_ref.shape[0]
    first_row, first_col = pl.program_id(0) * block_n, pl.program_id(1) * block_k
    rows = first_row + jax.lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)
    cols = first_col + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    w = decode_weights(w_ref, jnp.minimum(rows, n - 1), cols, qtype)
    from jax.experimental.pallas import triton as plgpu

    tile = o_ref.at[pl.ds(first_row, block_n), pl.ds(first_col, block_k)]
    plgpu.store(tile, w.astype(o_ref.dtype), mask=jnp.broadcast_to(rows < n, w.shape))


@functools.partial(jax.jit, static_argnames=("qtype", "out_dtype", "interpret"))
def dequantize_gpu(qweight, qtype: str, out_dtype, interpret):
    """uint8 [N, row_bytes] of `qtype` blocks -> [N, K] in out_dtype (float32 / float16 / bfloat16)."""
    from jax.experimental.pallas import triton as plgpu

    n, row = qweight.shape
    k = row // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    block_n, block_k = min(MAX_BLOCK_N, pl.next_power_of_2(n)), tile_k(qtype, k)
    return pl.pallas_call(
        functools.partial(_kernel, qtype=qtype, block_n=block_n, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((n, k), out_dtype),
        grid=(pl.cdiv(n, block_n), k // block_k),
        in_specs=[pl.no_block_spec],
        out_specs=pl.no_block_spec,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
    )(qweight)


def gguf_dequantize_pallas_gpu(qweight, qtype, dtype=jnp.float32, *, interpret=None):
    """uint8 [N, row_bytes] -> [N, K] in `dtype` (spec.py); float64 is decoded in float32 and
    converted, as the xla path does."""
    if qtype not in QTYPES:
        return gguf_dequantize_xla(qweight, qtype, dtype)
    interpret = gpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(dtype)
    n, row = qweight.shape
    blocks_per_row = row // BLOCK_BYTES[qtype]
    if n == 0 or blocks_per_row == 0:
        return jnp.zeros((n, blocks_per_row * BLOCK_WEIGHTS[qtype]), out_dtype)
    kernel_dtype = out_dtype if out_dtype in KERNEL_DTYPES else jnp.dtype(jnp.float32)
    return dequantize_gpu(qweight, qtype, kernel_dtype, interpret).astype(out_dtype)


GGUF_DEQUANTIZE.register_jax("pallas_gpu", gguf_dequantize_pallas_gpu)
