"""gguf_dequantize as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU): every block format of
the spec decoded in VMEM from the raw GGUF bytes by ../gguf_tpu.py (float32, the jnp decoder's
operations, so float32 output is bit-exact with it and with `gguf.quants`), rounded to `dtype`.

Grid (N / 128, K tiles): a step decodes 128 rows x one K tile of whole blocks to float32
[tile weights, 128] in VMEM, transposes it and writes [128, tile weights] of the output. Rows and
blocks are zero-padded to whole tiles by the wrapper and the result sliced. Other GGML type names
decode on the host through `gguf.quants` (xla.py's fallback), as the torch op does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.gguf_blocks import QTYPES
from kiln.ops.gemm.gguf_dequantize.spec import GGUF_DEQUANTIZE
from kiln.ops.gemm.gguf_dequantize.xla import gguf_dequantize_xla
from kiln.ops.gemm.gguf_tpu import (
    ROWS,
    blocks_per_tile,
    check_blocks_per_tile,
    decode_tile,
    tile_bytes,
    tiled_weight,
)
from kiln.ops.gemm.jax_codecs import jnp_dtype
from kiln.ops.pallas_common import tpu_interpret, tpu_params
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

KERNEL_DTYPES = tuple(jnp.dtype(t) for t in ("float32", "float16", "bfloat16"))


def _kernel(w_ref, o_ref, bytes_ref, decoded_ref, *, qtype: str, blocks: int):
    decode_tile(w_ref, bytes_ref, decoded_ref, qtype, blocks)
    o_ref[...] = decoded_ref[...].T.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("qtype", "out_dtype", "blocks", "interpret"))
def dequantize_tpu(qweight, qtype: str, out_dtype, blocks: int, interpret):
    """uint8 [N, row_bytes] of `qtype` blocks -> [N, K] in out_dtype (float32 / float16 / bfloat16)."""
    n, row = qweight.shape
    k = row // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    w = tiled_weight(qweight, qtype, blocks)
    padded_bytes, tile_weights = tile_bytes(qtype, blocks), blocks * BLOCK_WEIGHTS[qtype]
    grid = (w.shape[0] // ROWS, w.shape[1] // padded_bytes)
    out = pl.pallas_call(
        functools.partial(_kernel, qtype=qtype, blocks=blocks),
        out_shape=jax.ShapeDtypeStruct((w.shape[0], grid[1] * tile_weights), out_dtype),
        grid=grid,
        in_specs=[pl.BlockSpec((ROWS, padded_bytes), lambda i, kk: (i, kk))],
        out_specs=pl.BlockSpec((ROWS, tile_weights), lambda i, kk: (i, kk)),
        scratch_shapes=[
            pltpu.VMEM((padded_bytes, ROWS), jnp.int32),
            pltpu.VMEM((tile_weights, ROWS), jnp.float32),
        ],
        compiler_params=tpu_params("parallel", "parallel"),
        interpret=interpret,
    )(w)
    return out[:n, :k]


def gguf_dequantize_pallas_tpu(qweight, qtype, dtype=jnp.float32, *, tile_blocks=None, interpret=None):
    """uint8 [N, row_bytes] -> [N, K] in `dtype` (spec.py). `tile_blocks` overrides the K tile
    (../gguf_tpu.py's choice); float64 is decoded in float32 and converted, as the xla path does."""
    if qtype not in QTYPES:
        return gguf_dequantize_xla(qweight, qtype, dtype)
    interpret = tpu_interpret() if interpret is None else interpret
    out_dtype = jnp_dtype(dtype)
    n, row = qweight.shape
    blocks_per_row = row // BLOCK_BYTES[qtype]
    if n == 0 or blocks_per_row == 0:
        return jnp.zeros((n, blocks_per_row * BLOCK_WEIGHTS[qtype]), out_dtype)
    blocks = tile_blocks or blocks_per_tile(qtype, blocks_per_row)
    check_blocks_per_tile("gguf_dequantize", qtype, blocks)
    kernel_dtype = out_dtype if out_dtype in KERNEL_DTYPES else jnp.dtype(jnp.float32)
    return dequantize_tpu(qweight, qtype, kernel_dtype, blocks, interpret).astype(out_dtype)


GGUF_DEQUANTIZE.register_jax("pallas_tpu", gguf_dequantize_pallas_tpu)
