"""Fast CPU paged_prefill_attention: per sequence (prefills are few), gather its context with one
index_select over its blocks, then one fused SDPA call (explicit float32 scores when soft-capping);
see kiln.ops.attention.cpu_sdpa."""

from __future__ import annotations

from kiln.ops.alloc import empty_like
from kiln.ops.attention.cpu_exact import exact_slots, overlay_exact
from kiln.ops.attention.cpu_sdpa import attend_sequence, compute_dtype
from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION
from kiln.ops.registry import Implementation, cpu_only


def _gather_context(cache, blocks, length, scale, dtype, exact=None):
    """Tokens [0, length) of one sequence: cache [N, bs, Hkv, D], blocks int [n] -> [length, Hkv, D].
    exact: (exact_cache, mask, slots) of an fp8 cache's exact positions (cpu_exact), laid over the
    gathered tokens before they are scaled."""
    tokens = cache.index_select(0, blocks).flatten(0, 1)[:length]
    if exact is not None:
        exact_cache, mask, slots = exact
        tokens = overlay_exact(tokens.to(dtype)[None], exact_cache, mask, slots)[0]
    if scale is not None:
        return tokens.to(dtype) * scale.to(dtype)[:, None]
    return tokens


def paged_prefill_attention_cpu(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    max_seqlen_q,
    scale=None,
    sliding_window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    exact_key_cache=None,
    exact_value_cache=None,
    exact_block_tables=None,
    exact_window=0,
):
    out = empty_like(q)
    block_size = key_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    for b, k_len in enumerate(seq_lens.tolist()):
        qs, qe = starts[b], starts[b + 1]
        if qe == qs:
            continue
        blocks = block_tables[b, : -(-k_len // block_size)].long()
        exact_k = exact_v = None
        if exact_block_tables is not None:
            mask, slots = exact_slots(
                exact_block_tables[b : b + 1], seq_lens[b : b + 1], k_len, block_size, exact_window
            )
            exact_k, exact_v = (exact_key_cache, mask, slots), (exact_value_cache, mask, slots)
        k = _gather_context(key_cache, blocks, k_len, k_scale, compute_dtype(q), exact_k)
        v = _gather_context(value_cache, blocks, k_len, v_scale, compute_dtype(q), exact_v)
        out[qs:qe], _ = attend_sequence(q[qs:qe], k, v, scale, True, sliding_window, softcap, False)
    return out


PAGED_PREFILL_ATTENTION.register(Implementation("cpu", paged_prefill_attention_cpu, cpu_only))
