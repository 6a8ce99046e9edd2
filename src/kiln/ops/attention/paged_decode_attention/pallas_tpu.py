"""paged_decode_attention as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); the op's
arguments and math are in spec.py (q [B, H, D] over the paged cache -> [B, H, D]).

Grid (B, max_blocks_per_seq), the page axis innermost ("arbitrary"). block_tables and seq_lens are
scalar-prefetched into SMEM, so the K/V index maps look up the physical page of logical page i
directly: the DMA engine gathers the pages, no gather pass over the cache. Logical pages past the
sequence (or before its window) clamp to the last (first) visible one, so Pallas sees an unchanged
block index and issues no copy, and their compute is skipped. A page block is [block_size, Hkv, D]
(its last two dims whole, as Mosaic wants); the query is reshaped to [Hkv, group, D] so each kv head
meets its query group as one aligned tile. m, l and acc live in VMEM scratch across pages.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.jax_common import NEG_INF, dot_precision, finish_softmax, online_softmax_update
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION
from kiln.ops.pallas_common import squeezed, tpu_interpret, tpu_params


def _page_range(seq_len, block_size, window):
    """(first, last) logical page holding a visible key."""
    last = jax.lax.div(jnp.maximum(seq_len - 1, 0), jnp.int32(block_size))
    if window is None:
        return jnp.int32(0), last
    first_key = jnp.maximum(seq_len - window, 0)
    return jax.lax.div(first_key, jnp.int32(block_size)), last


def _kernel(
    block_tables_ref, seq_lens_ref, *refs,
    scale, window, softcap, block_size, kv_heads, quantized,
):  # fmt: skip
    if quantized:
        k_scale_ref, v_scale_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref = refs
    b, i = pl.program_id(0), pl.program_id(1)
    seq_len = seq_lens_ref[b]

    @pl.when(i == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    first, last = _page_range(seq_len, block_size, window)

    @pl.when((i >= first) & (i <= last))
    def _():
        precision = dot_precision(q_ref.dtype)
        cols = i * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        visible = cols < seq_len
        if window is not None:
            visible &= (seq_len - 1) - cols < window
        # Slots of the last page past seq_len are never read by contract (NaN there must not leak
        # through probability 0 times value): their values are zeroed; their scores are masked.
        read = (i * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len
        for g in range(kv_heads):  # static: each kv head against its query group
            q = q_ref[g]  # [group, D]
            k, v = k_ref[:, g, :], v_ref[:, g, :]  # [block_size, D]
            if quantized:
                k = (k.astype(jnp.float32) * k_scale_ref[g]).astype(q.dtype)
                v = (v.astype(jnp.float32) * v_scale_ref[g]).astype(q.dtype)
            v = jnp.where(read, v, jnp.zeros((), v.dtype))
            s = jax.lax.dot_general(
                q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
            )
            s = s * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            s = jnp.where(visible, s, NEG_INF)
            m, l_, acc = online_softmax_update(s, v, m_ref[g], l_ref[g], acc_ref[g], precision)
            m_ref[g], l_ref[g], acc_ref[g] = m, l_, acc

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        out, _ = finish_softmax(m_ref[...], l_ref[...], acc_ref[...])
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "interpret"))
def _paged_decode_tpu(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, scale, window, softcap, interpret
):
    batch, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    quantized = k_scale is not None

    def page_index(b, i, block_tables_ref, seq_lens_ref):
        first, last = _page_range(seq_lens_ref[b], block_size, window)
        # max(.., 0): an empty sequence still names a real page (its compute is skipped).
        return jnp.maximum(block_tables_ref[b, jnp.clip(i, first, last)], 0), 0, 0, 0

    q_spec = pl.BlockSpec((squeezed(), kv_heads, group, head_dim), lambda b, i, *_: (b, 0, 0, 0))
    page_spec = pl.BlockSpec((squeezed(), block_size, kv_heads, head_dim), page_index)
    in_specs, operands = [q_spec, page_spec, page_spec], [q.reshape(batch, kv_heads, group, head_dim)]
    operands += [key_cache, value_cache]
    if quantized:
        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        in_specs = [smem, smem, *in_specs]
        operands = [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), *operands]
    kernel = functools.partial(
        _kernel, scale=scale, window=window, softcap=softcap, block_size=block_size, kv_heads=kv_heads,
        quantized=quantized,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, block_tables.shape[1]),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((kv_heads, group, 1), jnp.float32),
                pltpu.VMEM((kv_heads, group, 1), jnp.float32),
                pltpu.VMEM((kv_heads, group, head_dim), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, kv_heads, group, head_dim), q.dtype),
        compiler_params=tpu_params("parallel", "arbitrary"),
        interpret=interpret,
    )(block_tables, seq_lens, *operands)
    return out.reshape(batch, heads, head_dim)


def paged_decode_attention_pallas_tpu(
    q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
    k_scale=None, v_scale=None, *, interpret=None,
):  # fmt: skip
    """q [B, H, D] over the paged cache -> [B, H, D]; the Mosaic TPU kernel (interpreted off-TPU)."""
    if q.shape[0] == 0:
        return jnp.zeros(q.shape, q.dtype)
    interpret = tpu_interpret() if interpret is None else interpret
    return _paged_decode_tpu(
        q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
        scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
        window=None if sliding_window is None else int(sliding_window),
        softcap=None if softcap is None else float(softcap),
        interpret=interpret,
    )  # fmt: skip


PAGED_DECODE_ATTENTION.register_jax("pallas_tpu", paged_decode_attention_pallas_tpu)
