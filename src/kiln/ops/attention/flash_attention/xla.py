"""flash_attention in plain jax.numpy (scores materialized, masked, softmaxed; XLA fuses it).

The kernels work on a padded batch (kiln.ops.attention.jax_common: q [B, Sq, H, D], k/v
[B, Sk, Hkv, D], per-row lengths) and return (out [B, Sq, H, D], lse float32 [B, H, Sq]);
`over_varlen` puts the op's varlen signature over them.
"""

from __future__ import annotations

import functools

import jax

from kiln.ops.attention.flash_attention.spec import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.attention.jax_common import attend_padded, over_varlen, static_options


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
