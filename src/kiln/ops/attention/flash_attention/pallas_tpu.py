"""flash_attention as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU), on a padded batch.

Online softmax (FlashAttention-2): a program owns one (batch, head, query block); it walks the key
blocks keeping the running max m, denominator l and unnormalized output acc in float32, rescaling by
exp(m_old - m_new) whenever the max grows; the division by l happens once at the end.

Grid (B, H, q blocks, kv blocks) with the kv axis innermost ("arbitrary") and m/l/acc in VMEM
scratch across it. q/k/v are transposed to [B, H, S, D] so a block's last two dims are (rows, D)
with D the whole dim; lengths are scalar-prefetched into SMEM, so the kv index map clamps to the last
block a query block can see (no DMA for blocks the mask removes) and fully masked blocks skip their
compute. Layouts and math: xla.py and kiln.ops.attention.jax_common.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.flash_attention.spec import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    finish_softmax,
    kv_block_index,
    kv_block_range,
    online_softmax_update,
    over_varlen,
    reset_softmax_state,
    scores,
    softmax_scratch,
    static_options,
    tile_coords,
    tile_program,
    visible_mask,
)
from kiln.ops.pallas_common import pad_to, round_up, squeezed, tpu_interpret, tpu_params


def _tpu_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    i, j, q_len, kv_len = tile_program(q_lens_ref, kv_lens_ref)

    @pl.when(j == 0)
    def _():
        reset_softmax_state(m_ref, l_ref, acc_ref)

    first, last = kv_block_range(i, block_q, block_k, q_len, kv_len, causal, window)

    @pl.when((j >= first) & (j <= last))
    def _():
        precision = dot_precision(q_ref.dtype)
        s = scores(q_ref[...], k_ref[...], scale, softcap, precision)
        rows, cols = tile_coords(i, j, s.shape)
        s = jnp.where(visible_mask(rows, cols, kv_len - q_len, kv_len, causal, window), s, NEG_INF)
        m, l_, acc = online_softmax_update(s, v_ref[...], m_ref[...], l_ref[...], acc_ref[...], precision)
        m_ref[...], l_ref[...], acc_ref[...] = m, l_, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        out, lse = finish_softmax(m_ref[...], l_ref[...], acc_ref[...])
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _flash_tpu(q, k, v, q_lens, kv_lens, scale, causal, window, softcap, block_q, block_k, interpret):
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(128, round_up(seq_q, 16))
    block_k = block_k or min(128, round_up(seq_k, 16))
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)
    qt = pad_to(jnp.swapaxes(q, 1, 2), 2, sq)  # [B, H, Sq, D]
    kt, vt = (pad_to(jnp.swapaxes(a, 1, 2), 2, sk) for a in (k, v))

    q_spec = pl.BlockSpec((squeezed(), squeezed(), block_q, head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    kv_index = kv_block_index(group, block_q, block_k, causal, window)
    kv_spec = pl.BlockSpec((squeezed(), squeezed(), block_k, head_dim), kv_index)
    lse_spec = pl.BlockSpec((squeezed(), squeezed(), block_q, 1), lambda b, h, i, j, *_: (b, h, i, 0))
    kernel = functools.partial(
        _tpu_kernel,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, sq // block_q, sk // block_k),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=softmax_scratch((), block_q, head_dim),
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, sq, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq, 1), jnp.float32),
        ],
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q_lens, kv_lens, qt, kt, vt)
    return jnp.swapaxes(out[:, :, :seq_q], 1, 2), lse[:, :, :seq_q, 0]


def flash_attention_padded_pallas_tpu(
    q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Padded batch -> (out [B, Sq, H, D], lse [B, H, Sq]); the Mosaic TPU kernel (interpreted off-TPU)."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = tpu_interpret() if interpret is None else interpret
    return _flash_tpu(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window, softcap=softcap,
        block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip


flash_attention_pallas_tpu = over_varlen(flash_attention_padded_pallas_tpu, with_lse=False)
flash_attention_with_lse_pallas_tpu = over_varlen(flash_attention_padded_pallas_tpu, with_lse=True)

FLASH_ATTENTION.register_jax("pallas_tpu", flash_attention_pallas_tpu)
FLASH_ATTENTION_WITH_LSE.register_jax("pallas_tpu", flash_attention_with_lse_pallas_tpu)
