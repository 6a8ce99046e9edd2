"""softmax as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for the math.

A program owns `block_rows` full rows (the last dim is the whole row, which Mosaic accepts); rows
are padded to a multiple of block_rows.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, round_up, row_block, tpu_interpret, tpu_params
from kiln.ops.softmax.softmax.spec import SOFTMAX
from kiln.ops.softmax.softmax.xla import over_rows, row_kernel


@functools.partial(jax.jit, static_argnames=("inv_temperature", "interpret"))
def _softmax_tpu(x, inv_temperature, interpret):
    rows, n = x.shape
    block_rows = row_block(rows, n * 4 * 2, x.dtype)
    padded_rows = round_up(rows, block_rows)
    spec = pl.BlockSpec((block_rows, n), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(row_kernel, inv_temperature=inv_temperature),
        out_shape=jax.ShapeDtypeStruct((padded_rows, n), x.dtype),
        grid=(padded_rows // block_rows,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(pad_to(x, 0, padded_rows))
    return out[:rows]


def softmax_pallas_tpu(x, temperature: float = 1.0, *, interpret=None):
    """x [..., n]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2, inv_temperature):
        return _softmax_tpu(x2, inv_temperature=inv_temperature, interpret=interpret)

    return over_rows(kernel, x, temperature)


SOFTMAX.register_jax("pallas_tpu", softmax_pallas_tpu)
