"""rms_norm as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for the math."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kiln.ops.norm.rms_norm.spec import RMS_NORM
from kiln.ops.norm.rms_norm.xla import over_rows, rows_kernel
from kiln.ops.pallas_common import pad_to, round_up, row_block, tpu_interpret, tpu_params

# ---- TPU (Mosaic): a program owns `block_rows` full rows; the whole row is one block (last dim =
# the full hidden size, which Mosaic accepts), rows are padded to a multiple of block_rows.


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_tpu(x, weight, residual, eps, interpret):
    rows, hidden = x.shape
    block_rows = row_block(rows, hidden * 4 * (3 if residual is not None else 2), x.dtype)
    padded_rows = round_up(rows, block_rows)
    row_spec = pl.BlockSpec((block_rows, hidden), lambda i: (i, 0))
    operands = [pad_to(x, 0, padded_rows)]
    in_specs = [row_spec]
    if residual is not None:
        operands.append(pad_to(residual, 0, padded_rows))
        in_specs.append(row_spec)
    operands.append(weight.reshape(1, hidden))
    in_specs.append(pl.BlockSpec((1, hidden), lambda i: (0, 0)))
    out_shape = jax.ShapeDtypeStruct((padded_rows, hidden), x.dtype)
    outs = pl.pallas_call(
        functools.partial(rows_kernel, eps=eps, hidden=hidden, has_residual=residual is not None),
        out_shape=(out_shape, out_shape) if residual is not None else out_shape,
        grid=(padded_rows // block_rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec) if residual is not None else row_spec,
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands)
    if residual is None:
        return outs[:rows]
    return outs[0][:rows], outs[1][:rows]


def rms_norm_pallas_tpu(
    x, weight, eps: float = 1e-6, residual=None, weight_offset: float = 0.0, *, interpret=None
):
    """x, residual [..., hidden], weight [hidden]; the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret

    def kernel(x2, w, e, r):
        return _rms_norm_tpu(x2, w, r, eps=e, interpret=interpret)

    return over_rows(kernel, x, weight, eps, residual, weight_offset)


RMS_NORM.register_jax("pallas_tpu", rms_norm_pallas_tpu)
