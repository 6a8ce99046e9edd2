"""flash_attention as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU), on a padded
batch. Online softmax as in pallas_tpu.py: grid (B, H, q blocks); each program loops over the kv
blocks with fori_loop up to the last one it can see; D is padded to a power of two, as Triton needs.
Layouts and math: xla.py and kiln.ops.attention.jax_common.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.attention.flash_attention.spec import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    finish_softmax,
    kv_block_range,
    online_softmax_update,
    over_varlen,
    scores,
    static_options,
    visible_mask,
)
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up, squeezed


def _gpu_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    b, i = pl.program_id(0), pl.program_id(2)
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
    precision = dot_precision(q_ref.dtype)
    q = q_ref[...]
    rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

    def body(j, carry):
        m, l_, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = plgpu.load(k_ref.at[pl.ds(start, block_k), :])
        v = plgpu.load(v_ref.at[pl.ds(start, block_k), :])
        s = scores(q, k, scale, softcap, precision)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        s = jnp.where(visible_mask(rows, cols, kv_len - q_len, kv_len, causal, window), s, NEG_INF)
        return online_softmax_update(s, v, m, l_, acc, precision)

    init = (
        jnp.full((block_q, 1), NEG_INF, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    first, last = kv_block_range(i, block_q, block_k, q_len, kv_len, causal, window)
    m, l_, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out, lse = finish_softmax(m, l_, acc)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _flash_gpu(q, k, v, q_lens, kv_lens, scale, causal, window, softcap, block_q, block_k, interpret):
    from jax.experimental.pallas import triton as plgpu

    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(64, max(16, pl.next_power_of_2(seq_q)))
    block_k = block_k or min(64, max(16, pl.next_power_of_2(seq_k)))
    d = pl.next_power_of_2(head_dim)
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)
    qp = pad_to(pad_to(q, 1, sq), 3, d)
    kp, vp = (pad_to(pad_to(a, 1, sk), 3, d) for a in (k, v))
    whole = pl.no_block_spec  # the per-batch lengths: whole [B] arrays, read by index
    q_spec = pl.BlockSpec((squeezed(), block_q, squeezed(), d), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((squeezed(), sk, squeezed(), d), lambda b, h, i: (b, 0, h // group, 0))
    lse_spec = pl.BlockSpec((squeezed(), squeezed(), block_q), lambda b, h, i: (b, h, i))
    kernel = functools.partial(
        _gpu_kernel,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, sq // block_q),
        in_specs=[whole, whole, q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((batch, sq, heads, d), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(q_lens, kv_lens, qp, kp, vp)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]


def flash_attention_padded_pallas_gpu(
    q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Padded batch -> (out [B, Sq, H, D], lse [B, H, Sq]); the Pallas Triton kernel (interpreted off-GPU)."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = gpu_interpret() if interpret is None else interpret
    return _flash_gpu(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window, softcap=softcap,
        block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip


flash_attention_pallas_gpu = over_varlen(flash_attention_padded_pallas_gpu, with_lse=False)
flash_attention_with_lse_pallas_gpu = over_varlen(flash_attention_padded_pallas_gpu, with_lse=True)

FLASH_ATTENTION.register_jax("pallas_gpu", flash_attention_pallas_gpu)
FLASH_ATTENTION_WITH_LSE.register_jax("pallas_gpu", flash_attention_with_lse_pallas_gpu)
