"""paged_decode_attention as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU); the op's
arguments and math are in spec.py (q [B, H, D] over the paged cache -> [B, H, D]).

Grid (B, Hkv): a program owns one sequence's query group of one kv head ([group, D], padded to
powers of two as Triton needs) and walks the sequence's visible pages with fori_loop, reading each
physical page through the block table (whole-array refs, pages loaded by index), with an online
softmax in float32. Decode is memory-bound and the group is small, so the scores and P V are
broadcast-multiply-sums rather than tl.dot (which wants 16 rows). head_dim is zero-padded to a
power of two: free for 64/128, a copy of the cache for other sizes.

An fp8 cache's exact positions: exact_block_tables and the exact caches are whole-array operands too;
each page's exact slots (the first block, the last exact_window positions) are loaded from the exact
block its table names under a row mask, so a page without any reads nothing more, and replace the fp8
values before the scale (jax_common.gpu_exact_overlay).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.attention.jax_common import NEG_INF, decode_page_range, finish_softmax, over_paged_decode
from kiln.ops.attention.jax_exact import exact_window_page, gpu_exact_overlay, ring_size
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION
from kiln.ops.pallas_common import gpu_interpret, pad_to, squeezed


def _gpu_kernel(
    block_tables_ref, seq_lens_ref, *refs, scale, window, softcap, block_size, quantized, exact,
    exact_window, ring,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    if quantized:
        k_scale_ref, v_scale_ref, *refs = refs
    q_ref, k_ref, v_ref, *refs = refs
    exact_refs, (o_ref,) = (refs[:3], refs[3:]) if exact else (None, refs)
    b, h = pl.program_id(0), pl.program_id(1)
    seq_len = seq_lens_ref[b]
    q = q_ref[...].astype(jnp.float32)  # [G, D]
    width = q.shape[-1]
    page_rows = (pl.ds(0, block_size), h, pl.ds(0, width))
    window_page = exact_window_page(seq_len, block_size, exact_window) if exact else None

    def body(j, carry):
        m, l_, acc = carry
        page = jnp.maximum(block_tables_ref[b, j], 0)
        k = plgpu.load(k_ref.at[(page, *page_rows)]).astype(jnp.float32)  # [block_size, D]
        v = plgpu.load(v_ref.at[(page, *page_rows)]).astype(jnp.float32)
        if exact:
            k, v = gpu_exact_overlay(
                k, v, exact_refs, b, j, page_rows, seq_len, window_page, window=exact_window, ring=ring
            )
        if quantized:
            k, v = k * k_scale_ref[h], v * v_scale_ref[h]
        cols = j * block_size + jax.lax.broadcasted_iota(jnp.int32, (1, block_size), 1)
        visible = cols < seq_len
        if window is not None:
            visible &= (seq_len - 1) - cols < window
        # Slots past seq_len are never read by contract (NaN there must not reach the sum).
        v = jnp.where(jnp.reshape(visible, (block_size, 1)), v, 0.0)
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1) * scale  # [G, block_size]
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(visible, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m - m_safe)
        pv = jnp.sum(p[:, :, None] * v[None, :, :], axis=1)  # [G, D]
        return m_new, alpha * l_ + jnp.sum(p, axis=1, keepdims=True), alpha * acc + pv

    rows = q.shape[0]
    init = (
        jnp.full((rows, 1), NEG_INF, jnp.float32),
        jnp.zeros((rows, 1), jnp.float32),
        jnp.zeros((rows, width), jnp.float32),
    )
    first, last = decode_page_range(seq_len, block_size, window)
    last = jnp.where(seq_len > 0, last, first - 1)  # an empty sequence reads no page
    m, l_, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out, _ = finish_softmax(m, l_, acc)
    o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "window", "softcap", "exact_window", "interpret"))
def _paged_decode_gpu(
    q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache, exact_value_cache,
    exact_block_tables, scale, window, softcap, exact_window, interpret,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    batch, heads, head_dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    group_rows, width = pl.next_power_of_2(group), pl.next_power_of_2(head_dim)
    quantized, exact = k_scale is not None, exact_block_tables is not None
    qg = pad_to(pad_to(q.reshape(batch, kv_heads, group, head_dim), 2, group_rows), 3, width)
    caches = [pad_to(c, 3, width) for c in (key_cache, value_cache)]
    whole = pl.no_block_spec  # block tables, lengths, scales and the caches: read by index
    q_spec = pl.BlockSpec((squeezed(), squeezed(), group_rows, width), lambda b, h: (b, h, 0, 0))
    operands = [block_tables, seq_lens]
    if quantized:
        operands += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
    operands += [qg, *caches]
    if exact:
        operands += [exact_block_tables, *(pad_to(c, 3, width) for c in (exact_key_cache, exact_value_cache))]
    in_specs = [q_spec if op is qg else whole for op in operands]
    kernel = functools.partial(
        _gpu_kernel, scale=scale, window=window, softcap=softcap, block_size=block_size,
        quantized=quantized, exact=exact, exact_window=exact_window,
        ring=ring_size(exact_block_tables, exact_window) if exact else 0,
    )  # fmt: skip
    out = pl.pallas_call(
        kernel,
        grid=(batch, kv_heads),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(*operands)
    return out[:, :, :group, :head_dim].reshape(batch, heads, head_dim)


# q [B, H, D] over the paged cache -> [B, H, D]; interpreted off the kernel's hardware.
paged_decode_attention_pallas_gpu = over_paged_decode(_paged_decode_gpu, gpu_interpret)

PAGED_DECODE_ATTENTION.register_jax("pallas_gpu", paged_decode_attention_pallas_gpu)
