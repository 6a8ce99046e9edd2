"""write_kv_cache as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); the op's arguments
and math are in spec.py.

Grid (num_tokens,), one program per token, in order ("arbitrary": a repeated slot keeps the last
token's row, as the other backends do). slot_mapping is scalar-prefetched into SMEM. The caches stay
in HBM (memory_space ANY) and alias the outputs; a program converts its token's [Hkv, D] key and
value rows to the cache dtype in VMEM (fp8: divided by the scale, saturated, rounded) and DMAs them
to (slot // block_size, slot % block_size). A negative slot issues no DMA, so padding tokens and
every slot nobody writes are left untouched, with no read-modify-write of cache blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.attention.write_kv_cache.xla import to_cache_dtype
from kiln.ops.pallas_common import squeezed, tpu_interpret, tpu_params


def _kernel(slots_ref, *refs, block_size, quantized, compiled):
    if quantized:
        k_scale_ref, v_scale_ref, key_ref, value_ref, _, _, key_cache, value_cache, rows, sems = refs
        scales = (k_scale_ref[...], v_scale_ref[...])
    else:
        key_ref, value_ref, _, _, key_cache, value_cache, rows, sems = refs
        scales = (None, None)
    slot = slots_ref[pl.program_id(0)]

    @pl.when(slot >= 0)
    def _():
        block = jax.lax.div(slot, jnp.int32(block_size))
        offset = jax.lax.rem(slot, jnp.int32(block_size))
        copies = []
        for i, (data_ref, cache, scale) in enumerate(
            ((key_ref, key_cache, scales[0]), (value_ref, value_cache, scales[1]))
        ):
            rows[i] = to_cache_dtype(data_ref[...], rows.dtype, scale, compiled=compiled)
            copies.append(pltpu.make_async_copy(rows.at[i], cache.at[block, offset], sems.at[i]))
            copies[-1].start()
        for copy in copies:
            copy.wait()


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_tpu(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret):
    tokens, kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    quantized = k_scale is not None
    row_spec = pl.BlockSpec((squeezed(), kv_heads, head_dim), lambda t, *_: (t, 0, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    in_specs, operands = [row_spec, row_spec, hbm, hbm], [key, value, key_cache, value_cache]
    if quantized:
        # The scales as [Hkv, 1] VMEM blocks (whole arrays), broadcast over head_dim in the kernel.
        scale_spec = pl.BlockSpec((kv_heads, 1), lambda t, *_: (0, 0))
        in_specs = [scale_spec, scale_spec, *in_specs]
        operands = [k_scale.reshape(kv_heads, 1), v_scale.reshape(kv_heads, 1), *operands]
    first_cache = len(operands) - 2 + 1  # operand positions count the scalar-prefetch slot_mapping
    return pl.pallas_call(
        functools.partial(
            _kernel, block_size=block_size, quantized=quantized, compiled=None if interpret else "mosaic"
        ),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(tokens,),
            in_specs=in_specs,
            out_specs=[hbm, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, kv_heads, head_dim), key_cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype)] * 2,
        input_output_aliases={first_cache: 0, first_cache + 1: 1},
        compiler_params=tpu_params("arbitrary"),
        interpret=interpret,
    )(slot_mapping.astype(jnp.int32), *operands)


def write_kv_cache_pallas_tpu(
    key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, *, interpret=None
):
    """key/value [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (negative = skip) -> the new (key_cache, value_cache); the Mosaic TPU kernel (interpreted off-TPU)."""
    if key.shape[0] == 0:
        return key_cache, value_cache
    interpret = tpu_interpret() if interpret is None else interpret
    key_cache, value_cache = _write_tpu(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret=interpret
    )
    return key_cache, value_cache


WRITE_KV_CACHE.register_jax("pallas_tpu", write_kv_cache_pallas_tpu)
