"""write_kv_cache as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU); the op's arguments
and math are in spec.py.

Grid (num_tokens,), one program per token. The caches are viewed flat as [num_slots, Hkv, D] and
alias the outputs, so nothing but the written rows moves. A program reads its slot from slot_mapping;
a negative slot (padding) does nothing. Otherwise it loads its token's [Hkv, D] key and value rows,
converts them to the cache dtype (xla.py's to_cache_dtype: fp8 caches divide by the per-head scale,
saturate to +-448 and round to nearest) and stores them at that slot. Triton blocks are powers of two,
so the row is a [pow2(Hkv), pow2(D)] block masked to [Hkv, D]. Programs run in parallel: with a slot
named twice (the engine never does), which token's row lands is unspecified, as for XLA's scatter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.attention.write_kv_cache.xla import to_cache_dtype
from kiln.ops.pallas_common import gpu_interpret


def _kernel(slots_ref, *refs, kv_heads: int, head_dim: int, quantized: bool, compiled: str | None):
    from jax.experimental.pallas import triton as plgpu

    if quantized:
        k_scale_ref, v_scale_ref, key_ref, value_ref, _, _, key_out, value_out = refs
        scale_refs = (k_scale_ref, v_scale_ref)
    else:
        key_ref, value_ref, _, _, key_out, value_out = refs
        scale_refs = (None, None)
    token = pl.program_id(0)
    slot = slots_ref[token]
    heads_p, dim_p = pl.next_power_of_2(kv_heads), pl.next_power_of_2(head_dim)
    heads = jax.lax.broadcasted_iota(jnp.int32, (heads_p, 1), 0)
    mask = (heads < kv_heads) & (jax.lax.broadcasted_iota(jnp.int32, (1, dim_p), 1) < head_dim)
    row = (pl.ds(0, heads_p), pl.ds(0, dim_p))

    @pl.when(slot >= 0)
    def _():
        pairs = zip((key_ref, value_ref), (key_out, value_out), scale_refs, strict=True)
        for data_ref, out_ref, scale_ref in pairs:
            rows = plgpu.load(data_ref.at[(token, *row)], mask=mask, other=0.0)
            scale = None
            if scale_ref is not None:  # [Hkv] -> [pow2(Hkv), 1], 1 on the padded heads
                heads_in = heads[:, 0] < kv_heads
                scale = plgpu.load(scale_ref.at[pl.ds(0, heads_p)], mask=heads_in, other=1.0)[:, None]
            stored = to_cache_dtype(rows, out_ref.dtype, scale, compiled=compiled)
            plgpu.store(out_ref.at[(slot, *row)], stored, mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _write_gpu(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret):
    from jax.experimental.pallas import triton as plgpu

    tokens, kv_heads, head_dim = key.shape
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    quantized = k_scale is not None
    flat = (num_slots, kv_heads, head_dim)
    operands = [key, value, key_cache.reshape(flat), value_cache.reshape(flat)]
    if quantized:
        operands = [k_scale, v_scale, *operands]
    first_cache = len(operands) - 2 + 1  # operand positions count slot_mapping first
    key_out, value_out = pl.pallas_call(
        functools.partial(
            _kernel,
            kv_heads=kv_heads,
            head_dim=head_dim,
            quantized=quantized,
            compiled=None if interpret else "triton",
        ),
        out_shape=[jax.ShapeDtypeStruct(flat, key_cache.dtype)] * 2,
        grid=(tokens,),
        in_specs=[pl.no_block_spec] * (len(operands) + 1),
        out_specs=[pl.no_block_spec, pl.no_block_spec],
        input_output_aliases={first_cache: 0, first_cache + 1: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1 if kv_heads * head_dim <= 512 else 4),
        interpret=interpret,
    )(slot_mapping.astype(jnp.int32), *operands)
    return key_out.reshape(key_cache.shape), value_out.reshape(value_cache.shape)


def write_kv_cache_pallas_gpu(
    key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, *, interpret=None
):
    """key/value [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (negative = skip) -> the new (key_cache, value_cache); the Pallas Triton kernel (interpreted
    off-GPU)."""
    if key.shape[0] == 0:
        return key_cache, value_cache
    interpret = gpu_interpret() if interpret is None else interpret
    return _write_gpu(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret=interpret)


WRITE_KV_CACHE.register_jax("pallas_gpu", write_kv_cache_pallas_gpu)
