"""flash_attention in plain jax.numpy (scores materialized, masked, softmaxed; XLA fuses it), and what
the Pallas kernels beside it share: which key blocks a query block can see, and the scaled scores.

The kernels work on a padded batch (kiln.ops.attention.jax_common: q [B, Sq, H, D], k/v
[B, Sk, Hkv, D], per-row lengths) and return (out [B, Sq, H, D], lse float32 [B, H, Sq]);
`over_varlen` puts the op's varlen signature over them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.flash_attention.spec import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.attention.jax_common import attend_padded, over_varlen, static_options


def last_kv_block(q_block, block_q, block_k, q_len, kv_len, causal):
    """Index of the last kv block that query block `q_block` can see (clamped to >= 0)."""
    last_key = kv_len - 1
    if causal:
        last_key = jnp.minimum(last_key, q_block * block_q + block_q - 1 + kv_len - q_len)
    # lax.div (truncating) on a non-negative value: jnp's floor division lowers through sign(), which
    # Mosaic only lowers with a real TPU's info.
    return jax.lax.div(jnp.maximum(last_key, 0), jnp.int32(block_k))


def first_kv_block(q_block, block_q, block_k, q_len, kv_len, window):
    """Index of the first kv block inside the sliding window of query block `q_block` (0 without one)."""
    if window is None:
        return 0
    first_key = q_block * block_q + kv_len - q_len - window + 1
    return jax.lax.div(jnp.maximum(first_key, 0), jnp.int32(block_k))


def scores(q, k, scale, softcap, precision):
    """q [bq, D] k [bk, D] -> float32 scale * q k^T, soft-capped when softcap is set."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap"))
def _flash_xla(q, k, v, q_lens, kv_lens, scale, causal, window, softcap):
    return attend_padded(q, k, v, q_lens, kv_lens, scale, causal, window, softcap)


def flash_attention_padded_xla(
    q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None
):
    """Padded batch -> (out [B, Sq, H, D], lse [B, H, Sq])."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    return _flash_xla(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window, softcap=softcap
    )


flash_attention_xla = over_varlen(flash_attention_padded_xla, with_lse=False)
flash_attention_with_lse_xla = over_varlen(flash_attention_padded_xla, with_lse=True)

FLASH_ATTENTION.register_jax("xla", flash_attention_xla)
FLASH_ATTENTION_WITH_LSE.register_jax("xla", flash_attention_with_lse_xla)
