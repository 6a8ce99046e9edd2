"""layer_norm as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for the math."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kiln.ops.norm.layer_norm.spec import LAYER_NORM
from kiln.ops.norm.layer_norm.xla import over_rows, rows_kernel
from kiln.ops.pallas_common import pad_to, round_up, row_block, tpu_interpret, tpu_params

# ---- TPU (Mosaic): a program owns `block_rows` full rows; the whole row is one block (last dim =
# the full hidden size, which Mosaic accepts), rows are padded to a multiple of block_rows (a zero
# row normalizes to the bias, and is sliced off).


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _layer_norm_tpu(x, weight, bias, eps, interpret):
    rows, hidden = x.shape
    block_rows = row_block(rows, hidden * 4 * 2, x.dtype)
    padded_rows = round_up(rows, block_rows)
    row_spec = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    vector_spec = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    operands, in_specs = [pad_to(x, 0, padded_rows), weight.reshape(1, hidden)], [row_spec, vector_spec]
    if bias is not None:
        operands.append(bias.reshape(1, hidden))
        in_specs.append(vector_spec)
    out = pl.pallas_call(
        functools.partial(rows_kernel, eps=eps, hidden=hidden, has_bias=bias is not None),
        out_shape=jax.ShapeDtypeStruct((padded_rows, hidden), x.dtype),
        grid=(padded_rows // block_rows,),
        in_specs=in_specs,
        out_specs=row_spec,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    return out[:rows]


def layer_norm_pallas_tpu(x, weight, bias=None, eps: float = 1e-5, *, interpret=None):
    """x [..., hidden], weight/bias [hidden]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2, w, b, e):
        return _layer_norm_tpu(x2, w, b, eps=e, interpret=interpret)

    return over_rows(kernel, x, weight, bias, eps)


LAYER_NORM.register_jax("pallas_tpu", layer_norm_pallas_tpu)
