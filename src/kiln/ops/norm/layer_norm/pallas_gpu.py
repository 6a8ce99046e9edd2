"""layer_norm as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See xla.py for the math."""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from kiln.ops.norm.layer_norm.spec import LAYER_NORM
from kiln.ops.norm.layer_norm.xla import over_rows, rows_kernel
from kiln.ops.pallas_common import gpu_interpret, pad_to, squeezed

# ---- GPU (Pallas Triton): one program per row. Triton blocks are powers of two, so the hidden
# dim is zero-padded to the next power of two (masked out of the variance by the kernel).


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def _layer_norm_gpu(x, weight, bias, eps, interpret):
    from jax.experimental.pallas import triton as plgpu

    rows, hidden = x.shape
    block = pl.next_power_of_2(hidden)
    row_spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    vector_spec = pl.BlockSpec((block,), lambda i: (0,))
    operands, in_specs = [pad_to(x, 1, block), pad_to(weight, 0, block)], [row_spec, vector_spec]
    if bias is not None:
        operands.append(pad_to(bias, 0, block))
        in_specs.append(vector_spec)
    out = pl.pallas_call(
        functools.partial(rows_kernel, eps=eps, hidden=hidden, has_bias=bias is not None),
        out_shape=jax.ShapeDtypeStruct((rows, block), x.dtype),
        grid=(rows,),
        in_specs=in_specs,
        out_specs=row_spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 16)),
        interpret=interpret,
    )(*operands)
    return out[:, :hidden]


def layer_norm_pallas_gpu(x, weight, bias=None, eps: float = 1e-5, *, interpret=None):
    """x [..., hidden], weight/bias [hidden]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret

    def kernel(x2, w, b, e):
        return _layer_norm_gpu(x2, w, b, eps=e, interpret=interpret)

    return over_rows(kernel, x, weight, bias, eps)


LAYER_NORM.register_jax("pallas_gpu", layer_norm_pallas_gpu)
