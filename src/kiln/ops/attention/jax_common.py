"""What the attention family's JAX backends share: the mask, one online-softmax step and its finish,
the key blocks (or cache pages) a query block can see and the index maps that clamp to them (the
Pallas kernels), attention over a padded batch in plain jax.numpy (the "xla" backends), the varlen
<-> padded-batch layout change that puts flash_attention's varlen signature over them, the paged
cache's gather (xla) and per-page step (Pallas TPU); where an fp8 cache's exact positions sit is in
jax_exact.py.

Padded-batch layout (jax.nn.dot_product_attention's): q [B, Sq, H, D], k/v [B, Sk, Hkv, D] with
q_lens/kv_lens int32 [B] the valid length of each batch row; rows past a length are ignored and their
outputs are garbage. The mask is the family's (kiln.ops.attention): bottom-right causal, sliding
window W keeps position - j < W.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.jax_exact import overlay_exact, static_exact_window

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


def scores(q, k, scale, softcap, precision):
    """q [bq, D] k [bk, D] -> float32 scale * q k^T, soft-capped when softcap is set."""
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


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


def gather_pages(cache, block_tables, seq_lens, scale, dtype, exact=None):
    """Each sequence's pages as a padded batch: cache [num_blocks, block_size, Hkv, D], block_tables
    int32 [B, max_blocks], seq_lens int32 [B] -> [B, max_blocks * block_size, Hkv, D] in `dtype`
    (fp8 pages times scale [Hkv] in float32 first). exact: (exact_cache, exact_block_tables, window)
    of an fp8 cache's exact positions, laid over the pages before the scale (overlay_exact). Slots at
    or past a sequence's length are never read by contract and may hold anything (NaN too): they are
    zeroed, since the length mask alone would leave probability 0 times a NaN value in the sum."""
    batch, max_blocks = block_tables.shape
    block_size = cache.shape[1]
    pages = cache[jnp.maximum(block_tables, 0)]  # unused entries may be -1; what they gather is zeroed
    pages = pages.reshape(batch, max_blocks * block_size, *cache.shape[2:])
    if exact is not None:
        pages = overlay_exact(pages, *exact, seq_lens)
    if scale is not None:
        pages = pages.astype(jnp.float32) * scale.astype(jnp.float32)[None, None, :, None]
    unread = jnp.arange(max_blocks * block_size)[None, :] >= seq_lens[:, None]
    return jnp.where(unread[:, :, None, None], jnp.zeros((), dtype), pages.astype(dtype))


def gather_kv_pages(
    key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache, exact_value_cache,
    exact_block_tables, exact_window, dtype,
):  # fmt: skip
    """(k, v) of gather_pages, each with its exact cache when exact_block_tables is given."""
    exact_k = exact_v = None
    if exact_block_tables is not None:
        exact_k = (exact_key_cache, exact_block_tables, exact_window)
        exact_v = (exact_value_cache, exact_block_tables, exact_window)
    k = gather_pages(key_cache, block_tables, seq_lens, k_scale, dtype, exact_k)
    return k, gather_pages(value_cache, block_tables, seq_lens, v_scale, dtype, exact_v)


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


# ---- Pallas kernels: which key blocks (pages) a query block sees --------------------------------


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


def kv_block_range(q_block, block_q, block_k, q_len, kv_len, causal, window):
    """(first, last) index of the blocks of block_k keys holding a key that query block `q_block`
    (of block_q queries, the last q_len of kv_len positions) can see; a paged cache's pages are such
    blocks (block_k = block_size)."""
    first = first_kv_block(q_block, block_q, block_k, q_len, kv_len, window)
    return first, last_kv_block(q_block, block_q, block_k, q_len, kv_len, causal)


def decode_page_range(seq_len, block_size, window):
    """(first, last) logical page holding a key that a decode query (position seq_len - 1) can see."""
    return kv_block_range(0, 1, block_size, 1, seq_len, True, window)


def tile_program(q_lens_ref, kv_lens_ref):
    """(i, j, q_len, kv_len) of a program on grid (B, H, query blocks, key blocks) with q_lens and
    kv_lens scalar-prefetched: its query block i, key block j and its batch row's lengths."""
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    return i, j, q_lens_ref[b], kv_lens_ref[b]


def tile_coords(i, j, shape):
    """(rows, cols) int32 `shape` = (block_q, block_k): the query and key index of each element of
    tile (i, j)."""
    rows = i * shape[0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = j * shape[1] + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return rows, cols


def kv_block_index(group, block_q, block_k, causal, window):
    """Index map of a k/v [block_k, D] BlockSpec on grid (B, H, query blocks, key blocks) over
    [B, Hkv, Sk, D] (q_lens, kv_lens scalar-prefetched): query head h reads kv head h // group, and a
    key block outside the ones the query block sees clamps to the nearest one (an unchanged block
    index: Pallas issues no copy; the kernel skips its compute)."""

    def index(b, h, i, j, q_lens_ref, kv_lens_ref):
        first, last = kv_block_range(i, block_q, block_k, q_lens_ref[b], kv_lens_ref[b], causal, window)
        return b, jax.lax.div(h, jnp.int32(group)), jnp.clip(j, first, last), 0

    return index


def physical_page(block_tables_ref, b, page, first, last):
    """Index of the [block_size, Hkv, D] cache block holding logical page `page` of sequence b, the
    page clamped to the visible [first, last] (no copy for the others). max(.., 0): an empty
    sequence still names a real page (its compute is skipped)."""
    return jnp.maximum(block_tables_ref[b, jnp.clip(page, first, last)], 0), 0, 0, 0


def reset_softmax_state(m_ref, l_ref, acc_ref):
    """Running max -inf, denominator and output 0 (the online softmax's start)."""
    m_ref[...] = jnp.full_like(m_ref, NEG_INF)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)


def softmax_scratch(lead, rows, head_dim):
    """float32 VMEM scratch for m, l [*lead, rows, 1] and acc [*lead, rows, head_dim]."""
    return [
        pltpu.VMEM((*lead, rows, 1), jnp.float32),
        pltpu.VMEM((*lead, rows, 1), jnp.float32),
        pltpu.VMEM((*lead, rows, head_dim), jnp.float32),
    ]


# ---- paged cache: the Pallas TPU kernels' page step ----------------------------------------------


def paged_tpu_operands(
    q_operand, q_spec, page_spec, key_cache, value_cache, k_scale, v_scale, exact_spec=None, exact_caches=()
):
    """(in_specs, operands) of the paged TPU kernels after their scalar prefetch: the fp8 scales [Hkv]
    (float32, in SMEM) when set, then the queries, the two caches and the exact caches (when given,
    blocks by `exact_spec`)."""
    in_specs, operands = [q_spec, page_spec, page_spec], [q_operand, key_cache, value_cache]
    if k_scale is not None:
        smem = pl.BlockSpec(memory_space=pltpu.SMEM)
        in_specs = [smem, smem, *in_specs]
        operands = [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32), *operands]
    return in_specs + [exact_spec] * len(exact_caches), operands + list(exact_caches)


def paged_tpu_refs(refs, quantized, exact):
    """The paged TPU kernels' refs after block_tables, seq_lens (and q_lens), as (k_scale_ref,
    v_scale_ref) (None unless quantized), q_ref, k_ref, v_ref, (exact_k_ref, exact_v_ref) (None
    unless exact), o_ref, (m_ref, l_ref, acc_ref); with exact, refs start with the scalar-prefetched
    exact_block_tables, which only the index maps read."""
    if exact:
        refs = refs[1:]
    scales = refs[:2] if quantized else (None, None)
    refs = refs[2:] if quantized else refs
    q_ref, k_ref, v_ref = refs[:3]
    exact_refs = refs[3:5] if exact else None
    o_ref, m_ref, l_ref, acc_ref = refs[5:] if exact else refs[3:]
    return scales, q_ref, k_ref, v_ref, exact_refs, o_ref, (m_ref, l_ref, acc_ref)


def paged_page_update(
    page, seq_len, visible, q_ref, k_ref, v_ref, scale_refs, state, *, scale, softcap, exact=None
):
    """One logical page of the paged TPU kernels: for each kv head g, its query tile q_ref[g]
    [rows, D] against the page's k/v [block_size, D] (fp8 pages times their scale refs' [Hkv] value,
    when set), scores masked by `visible` [rows, block_size], one online-softmax step on the state
    refs (m, l, acc) [Hkv, rows, ...]. exact: (exact_k_ref, exact_v_ref, rows bool [block_size, 1]):
    the exact blocks [block_size, Hkv, D] this page holds, taken over the fp8 values at `rows`
    before the scale (the same units)."""
    k_scale_ref, v_scale_ref = scale_refs
    m_ref, l_ref, acc_ref = state
    block_size = k_ref.shape[0]
    precision = dot_precision(q_ref.dtype)
    # Slots of the last page past seq_len are never read by contract (NaN there must not leak
    # through probability 0 times value): their values are zeroed; their scores are masked.
    read = (page * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)) < seq_len
    for g in range(q_ref.shape[0]):  # static: each kv head against its query group
        q = q_ref[g]  # [rows, D]
        k, v = k_ref[:, g, :], v_ref[:, g, :]  # [block_size, D]
        if exact is not None:
            exact_k_ref, exact_v_ref, rows = exact
            k = jnp.where(rows, exact_k_ref[:, g, :].astype(jnp.float32), k.astype(jnp.float32))
            v = jnp.where(rows, exact_v_ref[:, g, :].astype(jnp.float32), v.astype(jnp.float32))
        if k_scale_ref is not None:
            k = (k.astype(jnp.float32) * k_scale_ref[g]).astype(q.dtype)
            v = (v.astype(jnp.float32) * v_scale_ref[g]).astype(q.dtype)
        v = jnp.where(read, v, jnp.zeros((), v.dtype))
        s = jnp.where(visible, scores(q, k, scale, softcap, precision), NEG_INF)
        m, l_, acc = online_softmax_update(s, v, m_ref[g], l_ref[g], acc_ref[g], precision)
        m_ref[g], l_ref[g], acc_ref[g] = m, l_, acc


def write_softmax_out(o_ref, state):
    """o_ref = out (in o_ref's dtype) from the state refs (m, l, acc) (finish_softmax)."""
    out, _ = finish_softmax(*(ref[...] for ref in state))
    o_ref[...] = out.astype(o_ref.dtype)


def over_paged_decode(kernel, default_interpret):
    """paged_decode_attention's signature (q [B, H, D] over the paged cache -> [B, H, D], spec.py)
    over a jitted Pallas `kernel(q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale,
    exact_key_cache, exact_value_cache, exact_block_tables, *, scale, window, softcap, exact_window,
    interpret)`: an empty batch gives an empty result, the options become static, and `interpret`
    defaults to default_interpret() (off the kernel's own hardware)."""

    def paged_decode(
        q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
        k_scale=None, v_scale=None, exact_key_cache=None, exact_value_cache=None, exact_block_tables=None,
        exact_window=0, *, interpret=None,
    ):  # fmt: skip
        if q.shape[0] == 0:
            return jnp.zeros(q.shape, q.dtype)
        scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
        return kernel(
            q, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale, exact_key_cache,
            exact_value_cache, exact_block_tables, scale=scale, window=window, softcap=softcap,
            exact_window=static_exact_window(exact_block_tables, exact_window),
            interpret=default_interpret() if interpret is None else interpret,
        )  # fmt: skip

    return paged_decode
