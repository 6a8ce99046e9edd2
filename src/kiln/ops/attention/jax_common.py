"""What the attention family's JAX backends share: the mask, one online-softmax step and its finish
(the Pallas kernels), attention over a padded batch in plain jax.numpy (the "xla" backends), and the
varlen <-> padded-batch layout change that puts flash_attention's varlen signature over them.

Padded-batch layout (jax.nn.dot_product_attention's): q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with
q_lens/kv_lens int32 [B] the valid length of each batch row; rows past a length are ignored and their
outputs are garbage. The mask is the family's (kiln.ops.attention): bottom-right causal, sliding
window W keeps position - j < W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


def visible_mask(rows, cols, offset, kv_len, causal, window):
    """rows: query indices, cols: key indices (broadcastable); query i sits at key position i + offset."""
    position = rows + offset
    mask = cols < kv_len
    if causal:
        mask &= cols <= position
    if window is not None:
        mask &= position - cols < window
    return mask


def online_softmax_update(s, v, m_prev, l_prev, acc_prev, precision):
    """One FlashAttention-2 step on masked scores s [bq, bk] (masked = -inf): the running max m,
    denominator l and unnormalized output acc (float32) are rescaled by exp(m_old - m_new)."""
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    # A row with nothing visible yet keeps max -inf: subtract 0 instead, no NaN from -inf - -inf.
    m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    return m_new, l_new, alpha * acc_prev + pv


def finish_softmax(m, l, acc):
    """(out, lse) from the running state: out = acc / l, lse = m + log(l); a row that saw no key
    gets out 0 and lse -inf."""
    seen = l > 0.0
    out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    return out, lse


def dot_precision(dtype):
    """float32 inputs multiply at full float32 precision (not TF32/bf16 passes)."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


def static_options(scale, window, softcap, head_dim):
    """The kernels' static (jit-hashable) scale, window and softcap; scale defaults to D ** -0.5."""
    scale = float(head_dim**-0.5 if scale is None else scale)
    return scale, None if window is None else int(window), None if softcap is None else float(softcap)


def attend_padded(q, k, v, q_lens, kv_lens, scale, causal, window, softcap):
    """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> (out [B, Sq, H, D], lse float32 [B, H, Sq]), the scores
    materialized, masked and softmaxed in float32 (XLA fuses it)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    precision = dot_precision(q.dtype)
    qg = q.reshape(q.shape[0], q.shape[1], kv_heads, group, q.shape[3])
    s = (
        jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32, precision=precision)
        * scale
    )
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    rows = jnp.arange(q.shape[1])[:, None]
    cols = jnp.arange(k.shape[1])[None, :]
    offset = (kv_lens - q_lens)[:, None, None, None, None]
    mask = visible_mask(rows, cols, offset, kv_lens[:, None, None, None, None], causal, window)
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    p = jnp.exp(s - m_safe)
    l_ = jnp.sum(p, axis=-1, keepdims=True)
    seen = l_ > 0
    out = jnp.einsum(
        "bkgqs,bskd->bqkgd", p / jnp.where(seen, l_, 1.0), v.astype(jnp.float32), precision=precision
    )
    lse = jnp.where(seen, m_safe + jnp.log(jnp.where(seen, l_, 1.0)), NEG_INF)[..., 0]
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[0], heads, q.shape[1])


# ---- varlen <-> padded batch ---------------------------------------------------------------------


def to_padded(x, cu_seqlens, max_seqlen: int):
    """[total, ...] -> [B, max_seqlen, ...]: row (b, i) is token cu_seqlens[b] + i (a gather; rows past
    a sequence's length repeat some token and are masked by the kernels' lengths)."""
    starts = cu_seqlens[:-1]
    rows = jnp.minimum(starts[:, None] + jnp.arange(max(max_seqlen, 1)), x.shape[0] - 1)
    return x[rows]


def token_rows(cu_seqlens, total: int):
    """(sequence, position) of each of the `total` varlen tokens: token t is padded row (b, t - start_b)."""
    tokens = jnp.arange(total, dtype=cu_seqlens.dtype)
    seq = jnp.searchsorted(cu_seqlens[1:], tokens, side="right")
    return seq, tokens - cu_seqlens[seq]


def over_varlen(padded_kernel, with_lse: bool):
    """flash_attention's varlen signature over a padded-batch kernel `padded_kernel(q, k, v, q_lens,
    kv_lens, causal, scale, sliding_window, softcap) -> (out [B, Sq, H, D], lse [B, H, Sq])`.
    Returns out [total_q, H, D], or (out, lse float32 [H, total_q]) when `with_lse`."""

    def varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
        sliding_window=None, softcap=None,
    ):  # fmt: skip
        total_q, heads = q.shape[0], q.shape[1]
        if total_q == 0 or k.shape[0] == 0:  # nothing to attend to: out 0, lse -inf
            out = jnp.zeros(q.shape, q.dtype)
            lse = jnp.full((heads, total_q), NEG_INF, jnp.float32)
        else:
            q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).astype(jnp.int32)
            kv_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).astype(jnp.int32)
            padded_k, padded_v = (
                to_padded(k, cu_seqlens_k, max_seqlen_k),
                to_padded(v, cu_seqlens_k, max_seqlen_k),
            )
            out, lse = padded_kernel(
                to_padded(q, cu_seqlens_q, max_seqlen_q), padded_k, padded_v, q_lens, kv_lens, causal, scale,
                sliding_window, softcap,
            )  # fmt: skip
            seq, pos = token_rows(cu_seqlens_q, total_q)
            out, lse = out[seq, pos], lse[seq, :, pos].T
        return (out, lse) if with_lse else out

    return varlen


# ---- paged cache ---------------------------------------------------------------------------------


def gather_pages(cache, block_tables, seq_lens, scale, dtype):
    """Each sequence's pages as a padded batch: cache [num_blocks, block_size, Hkv, D], block_tables
    int32 [B, max_blocks], seq_lens int32 [B] -> [B, max_blocks * block_size, Hkv, D] in `dtype`
    (fp8 pages times scale [Hkv] in float32 first). Slots at or past a sequence's length are never
    read by contract and may hold anything (NaN too): they are zeroed, since the length mask alone
    would leave probability 0 times a NaN value in the sum."""
    batch, max_blocks = block_tables.shape
    block_size = cache.shape[1]
    pages = cache[jnp.maximum(block_tables, 0)]  # unused entries may be -1; what they gather is zeroed
    pages = pages.reshape(batch, max_blocks * block_size, *cache.shape[2:])
    if scale is not None:
        pages = pages.astype(jnp.float32) * scale.astype(jnp.float32)[None, None, :, None]
    unread = jnp.arange(max_blocks * block_size)[None, :] >= seq_lens[:, None]
    return jnp.where(unread[:, :, None, None], jnp.zeros((), dtype), pages.astype(dtype))


def over_varlen_backward(padded_backward):
    """flash_attention_backward's varlen signature over a padded-batch backward `padded_backward(dout,
    q, k, v, out, lse, q_lens, kv_lens, causal, scale, sliding_window, softcap, grad_lse) -> (dq, dk,
    dv)` (q-side arrays [B, Sq, H, D], k-side [B, Sk, Hkv, D], lse and grad_lse [B, H, Sq]): the
    varlen rows are gathered into [B, max_seqlen, ...] and the gradients gathered back."""

    def varlen(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
        scale=None, sliding_window=None, softcap=None, grad_lse=None,
    ):  # fmt: skip
        total_q, total_k = q.shape[0], k.shape[0]
        if total_q == 0 or total_k == 0:
            return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).astype(jnp.int32)
        kv_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).astype(jnp.int32)

        def rows_q(a):
            return to_padded(a, cu_seqlens_q, max_seqlen_q)

        def rows_k(a):
            return to_padded(a, cu_seqlens_k, max_seqlen_k)

        def by_head(a):  # [H, total_q] -> [B, H, Sq]
            return None if a is None else jnp.swapaxes(rows_q(a.T), 1, 2)

        dq, dk, dv = padded_backward(
            rows_q(dout), rows_q(q), rows_k(k), rows_k(v), rows_q(out), by_head(lse), q_lens, kv_lens,
            causal, scale, sliding_window, softcap, by_head(grad_lse),
        )  # fmt: skip
        seq_q, pos_q = token_rows(cu_seqlens_q, total_q)
        seq_k, pos_k = token_rows(cu_seqlens_k, total_k)
        return dq[seq_q, pos_q], dk[seq_k, pos_k], dv[seq_k, pos_k]

    return varlen
