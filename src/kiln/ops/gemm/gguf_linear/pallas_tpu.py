"""gguf_linear as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU): the weight crosses HBM as
the file's raw GGUF blocks and is decoded in VMEM by ../gguf_tpu.py (every block format of the spec).

Grid (M / block_m, N / 128, K tiles), K innermost ("arbitrary"). A step decodes 128 output rows x one
K tile of whole blocks (32 weights each for Q4_0 / Q4_1 / Q5_0 / Q8_0, 256 for the K-quants; 1024 or
2048 weights a tile, fewer for short rows) to float32 W^T [tile, 128], rounds it to x's dtype (as
xla.py rounds the decoded weight) and multiplies x's [block_m, tile] by it into a float32 VMEM
accumulator (fp32 x at HIGHEST precision, as linear's GEMMs); the last step adds the bias in float32
and rounds once to x's dtype. Every M tile decodes its weight tiles again: cheap next to the dot at
prefill sizes, and decode (M <= block_m) has one M tile. M, N and the blocks are zero-padded by the
wrapper (zero x columns and zero blocks add nothing), the result sliced. float64 x, which TPUs do not
compute, runs xla.py's path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.gemm.gguf_linear.spec import GGUF_LINEAR
from kiln.ops.gemm.gguf_linear.xla import gguf_linear_xla
from kiln.ops.gemm.gguf_tpu import (
    ROWS,
    blocks_per_tile,
    check_blocks_per_tile,
    decode_tile,
    tile_bytes,
    tiled_weight,
)
from kiln.ops.gemm.linear.xla import gemm_precision, over_rows
from kiln.ops.pallas_common import (
    pad_to,
    round_up,
    store_on_last_k,
    sublanes,
    tpu_interpret,
    tpu_params,
    zero_on_first_k,
)
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS

CONTRACT_K = (((1,), (0,)), ((), ()))  # x [m, k] . w^T [k, n]
KERNEL_DTYPES = tuple(jnp.dtype(t) for t in ("float32", "float16", "bfloat16"))


def _kernel(x_ref, w_ref, *refs, qtype: str, blocks: int, has_bias: bool, precision):
    bias_ref = refs[0] if has_bias else None
    o_ref, bytes_ref, decoded_ref, acc_ref = refs[-4:]
    zero_on_first_k(acc_ref)

    decode_tile(w_ref, bytes_ref, decoded_ref, qtype, blocks)
    w = decoded_ref[...].astype(x_ref.dtype)
    acc_ref[...] += jax.lax.dot_general(
        x_ref[...], w, CONTRACT_K, preferred_element_type=jnp.float32, precision=precision
    )

    store_on_last_k(acc_ref, o_ref, bias_ref)


@functools.partial(jax.jit, static_argnames=("qtype", "blocks", "block_m", "interpret"))
def gguf_gemm_tpu(x2, qweight, qtype: str, bias, blocks: int, block_m: int | None, interpret):
    """x [M, K] @ decode(qweight [N, row_bytes])^T (+ bias [N]) -> [M, N] in x's dtype."""
    m, n = x2.shape[0], qweight.shape[0]
    w = tiled_weight(qweight, qtype, blocks)
    padded_bytes, tile_weights = tile_bytes(qtype, blocks), blocks * BLOCK_WEIGHTS[qtype]
    tiles = w.shape[1] // padded_bytes
    block_m = block_m or min(256, round_up(m, max(sublanes(x2.dtype), 16)))
    mp, np_ = round_up(m, block_m), w.shape[0]
    operands = [pad_to(pad_to(x2, 0, mp), 1, tiles * tile_weights), w]
    in_specs = [
        pl.BlockSpec((block_m, tile_weights), lambda i, j, kk: (i, kk)),
        pl.BlockSpec((ROWS, padded_bytes), lambda i, j, kk: (j, kk)),
    ]
    if bias is not None:
        operands.append(pad_to(bias.astype(jnp.float32).reshape(1, n), 1, np_))
        in_specs.append(pl.BlockSpec((1, ROWS), lambda i, j, kk: (0, j)))
    kernel = functools.partial(
        _kernel, qtype=qtype, blocks=blocks, has_bias=bias is not None, precision=gemm_precision(x2.dtype)
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), x2.dtype),
        grid=(mp // block_m, np_ // ROWS, tiles),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_m, ROWS), lambda i, j, kk: (i, j)),
        scratch_shapes=[
            pltpu.VMEM((padded_bytes, ROWS), jnp.int32),
            pltpu.VMEM((tile_weights, ROWS), jnp.float32),
            pltpu.VMEM((block_m, ROWS), jnp.float32),
        ],
        compiler_params=tpu_params("parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)
    return out[:m, :n]


def gguf_linear_pallas_tpu(x, qweight, qtype, bias=None, *, tile_blocks=None, block_m=None, interpret=None):
    """x [..., K] @ W^T (+ bias) with W the GGUF `qtype` blocks uint8 [N, row_bytes] (spec.py), decoded
    in VMEM. `tile_blocks` (blocks per K tile) and `block_m` override ../gguf_tpu.py's tiling."""
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
        return gguf_linear_xla(x, qweight, qtype, bias)
    interpret = tpu_interpret() if interpret is None else interpret
    blocks_per_row = qweight.shape[1] // BLOCK_BYTES[qtype]
    blocks = tile_blocks or blocks_per_tile(qtype, blocks_per_row)
    check_blocks_per_tile("gguf_linear", qtype, blocks)
    if block_m is not None and (block_m <= 0 or block_m % sublanes(x.dtype)):
        raise ValueError(
            f"gguf_linear: block_m={block_m}, expected a positive multiple of {sublanes(x.dtype)}"
        )

    def kernel(x2):
        return gguf_gemm_tpu(x2, qweight, qtype, bias, blocks, block_m, interpret)

    return over_rows(kernel, x, qweight.shape[0], bias)


GGUF_LINEAR.register_jax("pallas_tpu", gguf_linear_pallas_tpu)
