"""rejection_sample in jax.numpy (XLA): the vectorized rule of cpu.py (all proposals' acceptances at
once, the accepted prefix as a cumulative product, the last token by the exponential race on the row
it selects). Token ids come back in draft_token_ids' integer dtype: int32 unless jax_enable_x64 is on
(JAX's default; the torch bridge imports int64 tensors as int32 then)."""

from __future__ import annotations

import jax.numpy as jnp

from kiln.ops.sampling.rejection_sample.spec import REJECTION_SAMPLE


def _residual(target, draft):
    """max(0, p - q) normalized over the vocabulary; p where the residual is zero everywhere."""
    residual = jnp.maximum(target - draft, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    tiny = jnp.finfo(total.dtype).tiny
    return jnp.where(total > 0, residual / jnp.maximum(total, tiny), target)


def rejection_sample_xla(
    target_probs, draft_token_ids, num_draft_tokens, draft_probs, uniforms, exponentials
):
    batch, k_max = draft_token_ids.shape
    int_dtype = draft_token_ids.dtype
    valid = jnp.arange(k_max)[None, :] < num_draft_tokens[:, None]
    tokens = jnp.where(valid, draft_token_ids, 0)
    p_rows = target_probs[:, :k_max]
    p_draft = jnp.take_along_axis(p_rows, tokens[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
        one_hot = (jnp.arange(target_probs.shape[-1])[None, None, :] == tokens[..., None]).astype(
            p_rows.dtype
        )
        residual = _residual(p_rows, one_hot)
    else:
        q_draft = jnp.take_along_axis(draft_probs, tokens[..., None], axis=-1)[..., 0]
        residual = _residual(p_rows, draft_probs)
    tiny = jnp.finfo(q_draft.dtype).tiny
    ratio = jnp.minimum(p_draft / jnp.maximum(q_draft, tiny), 1.0)
    accept_p = jnp.where(q_draft > 0, ratio, (p_draft > 0).astype(p_draft.dtype))
    accepted = (uniforms < accept_p) & valid
    num_accepted = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=-1), axis=-1)
    last_rows = jnp.concatenate([residual, target_probs[:, k_max:]], axis=1)  # [B, K+1, V]
    bonus = jnp.arange(k_max + 1)[None, :] >= num_draft_tokens[:, None]
    last_rows = jnp.where(bonus[..., None], target_probs, last_rows)
    rows = num_accepted[:, None, None]
    dist = jnp.take_along_axis(last_rows, rows, axis=1)[:, 0]
    noise = jnp.take_along_axis(exponentials, rows, axis=1)[:, 0]
    last_token = jnp.argmax(dist / noise, axis=-1).astype(int_dtype)
    positions = jnp.arange(k_max + 1)[None, :]
    padded = jnp.concatenate([draft_token_ids, jnp.full((batch, 1), -1, int_dtype)], axis=1)
    out = jnp.where(positions < num_accepted[:, None], padded, -1)
    out = jnp.where(positions == num_accepted[:, None], last_token[:, None], out).astype(int_dtype)
    return out, num_accepted.astype(num_draft_tokens.dtype)


REJECTION_SAMPLE.register_jax("xla", rejection_sample_xla)
