"""softmax as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU). See xla.py for the math.

One program per row. Triton blocks are powers of two, so the row is padded to the next power of two
with -inf, which exp turns into exact zeros (nothing added to the sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import gpu_interpret, squeezed
from kiln.ops.softmax.softmax.spec import SOFTMAX
from kiln.ops.softmax.softmax.xla import over_rows, row_kernel


@functools.partial(jax.jit, static_argnames=("inv_temperature", "interpret"))
def _softmax_gpu(x, inv_temperature, interpret):
    rows, n = x.shape
    block = pl.next_power_of_2(n)
    if block != n:
        x = jnp.pad(x, ((0, 0), (0, block - n)), constant_values=-jnp.inf)
    spec = pl.BlockSpec((squeezed(), block), lambda i: (i, 0))
    from jax.experimental.pallas import triton as plgpu

    out = pl.pallas_call(
        functools.partial(row_kernel, inv_temperature=inv_temperature),
        out_shape=jax.ShapeDtypeStruct((rows, block), x.dtype),
        grid=(rows,),
        in_specs=[spec],
        out_specs=spec,
        compiler_params=plgpu.CompilerParams(num_warps=min(max(block // 256, 1), 16)),
        interpret=interpret,
    )(x)
    return out[:, :n]


def softmax_pallas_gpu(x, temperature: float = 1.0, *, interpret=None):
    """x [..., n]; the Pallas Triton kernel (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret

    def kernel(x2, inv_temperature):
        return _softmax_gpu(x2, inv_temperature=inv_temperature, interpret=interpret)

    return over_rows(kernel, x, temperature)


SOFTMAX.register_jax("pallas_gpu", softmax_pallas_gpu)
