"""rms_norm as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See xla.py for the math."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kiln.ops.norm.rms_norm.spec import RMS_NORM
from kiln.ops.norm.rms_norm.xla import over_rows, rows_kernel
from kiln.ops.pallas_common import gpu_interpret, pad_to, squeezed

# ---- GPU (Pallas Triton): one program per row. Triton blocks are powers of two, so the hidden
# dim is zero-padded to the next power of two.


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _rms_norm_gpu(x, weight, residual, eps, interpret):
    rows, hidden = x.shape
    block = pl.next_power_of_2(hidden)
    row_spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    operands = [pad_to(x, 1, block)]
    in_specs = [row_spec]
    if residual is not None:
        operands.append(pad_to(residual, 1, block))
        in_specs.append(row_spec)
    operands.append(pad_to(weight, 0, block))
    in_specs.append(pl.BlockSpec((block,), lambda i: (0,)))
    out_shape = jax.ShapeDtypeStruct((rows, block), x.dtype)
    from jax.experimental.pallas import triton as plgpu

    outs = pl.pallas_call(
        functools.partial(rows_kernel, eps=eps, hidden=hidden, has_residual=residual is not None),
        out_shape=(out_shape, out_shape) if residual is not None else out_shape,
        grid=(rows,),
        in_specs=in_specs,
        out_specs=(row_spec, row_spec) if residual is not None else row_spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 16)),
        interpret=interpret,
    )(*operands)
    if residual is None:
        return outs[:, :hidden]
    return outs[0][:, :hidden], outs[1][:, :hidden]


def rms_norm_pallas_gpu(
    x, weight, eps: float = 1e-6, residual=None, weight_offset: float = 0.0, *, interpret=None
):
    """x, residual [..., hidden], weight [hidden]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret

    def kernel(x2, w, e, r):
        return _rms_norm_gpu(x2, w, r, eps=e, interpret=interpret)

    return over_rows(kernel, x, weight, eps, residual, weight_offset)


RMS_NORM.register_jax("pallas_gpu", rms_norm_pallas_gpu)
