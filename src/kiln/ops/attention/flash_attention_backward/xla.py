"""flash_attention_backward in plain jax.numpy (no autodiff): the spec's formulas on a padded batch,
P recomputed from q, k and the saved LSE, everything in float32 (XLA fuses it).

    P = exp(s - lse) on the visible keys,  dV = P^T dO,  dP = dO V^T,
    delta = rowsum(dO * O) - grad_lse,  dS = P (dP - delta) (times 1 - tanh^2 when soft-capping),
    dQ = scale dS K,  dK = scale dS^T Q  (dK, dV summed over each GQA group's query heads).
The [Sq, Sk] scores are materialized per (batch, head), as the forward's xla backend does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.attention.flash_attention_backward.spec import FLASH_ATTENTION_BACKWARD
from kiln.ops.attention.jax_common import NEG_INF, over_varlen_backward, static_options, visible_mask

HIGHEST = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "softcap"))
def _backward_xla(dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale, causal, window, softcap):
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    # Query-side arrays as [B, Sq, Hkv, G, D]: head h = kv head h // G, member h % G.
    qg, dog = (f32(a).reshape(batch, seq_q, kv_heads, group, head_dim) for a in (q, dout))
    kf, vf = f32(k), f32(v)
    s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kf, precision=HIGHEST) * scale
    if softcap is not None:
        capped = jnp.tanh(s / softcap)
        s = softcap * capped
    rows = jnp.arange(seq_q)[:, None]
    cols = jnp.arange(seq_k)[None, :]
    lens = lambda a: a[:, None, None, None, None]  # noqa: E731
    visible = visible_mask(rows, cols, lens(kv_lens - q_lens), lens(kv_lens), causal, window)
    visible &= rows < lens(q_lens)
    lse_g = lse.reshape(batch, kv_heads, group, seq_q)[..., None]  # [B, Hkv, G, Sq, 1]
    # lse is -inf for a query that sees no key: all its scores are masked, so P is 0 either way.
    p = jnp.where(visible, jnp.exp(s - jnp.where(lse_g == NEG_INF, 0.0, lse_g)), 0.0)
    delta = jnp.sum(dog * f32(out).reshape(qg.shape), axis=-1)  # [B, Sq, Hkv, G]
    delta = jnp.transpose(delta, (0, 2, 3, 1))[..., None]  # [B, Hkv, G, Sq, 1]
    if grad_lse is not None:  # a query that sees no key has a constant lse (-inf): no gradient
        glse = grad_lse.reshape(batch, kv_heads, group, seq_q)[..., None]
        delta = delta - jnp.where(lse_g == NEG_INF, 0.0, glse)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dog, vf, precision=HIGHEST)
    ds = jnp.where(visible, p * (dp - delta), 0.0)
    if softcap is not None:
        ds = ds * (1.0 - capped * capped)
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, dog, precision=HIGHEST)
    dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg, precision=HIGHEST) * scale
    dq = jnp.einsum("bkgqs,bskd->bqkgd", ds, kf, precision=HIGHEST) * scale
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def flash_attention_backward_padded_xla(
    dout, q, k, v, out, lse, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    grad_lse=None,
):  # fmt: skip
    """Padded batch (q/dout/out [B, Sq, H, D], k/v [B, Sk, Hkv, D], lse and grad_lse float32
    [B, H, Sq], int32 q_lens/kv_lens [B]) -> (dq, dk, dv) shaped and typed like q, k, v; rows past a
    length get zero gradients."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    if q.size == 0 or k.size == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    return _backward_xla(
        dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale=scale, causal=bool(causal), window=window,
        softcap=softcap,
    )  # fmt: skip


flash_attention_backward_xla = over_varlen_backward(flash_attention_backward_padded_xla)

FLASH_ATTENTION_BACKWARD.register_jax("xla", flash_attention_backward_xla)
