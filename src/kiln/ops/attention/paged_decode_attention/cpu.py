"""Fast CPU paged_decode_attention. Without soft-capping, a float cache, or a float8_e4m3fn one with its
scales and exact positions, goes to the native kernel (cpu_native: one C++ call per batch, eager or
inside a compiled graph) when it could be built; otherwise, the whole batch in one call: gather every
sequence's blocks (padded to the longest context) with one index_select per cache, zero the slots
past each sequence's length, then one SDPA with a key-padding mask (explicit float32 scores when
soft-capping). Traced by torch.compile (the compiled CPU decode step, kiln.engine.cpu_compiled_step),
a float cache without soft-capping is read by `_decode_in_graph`, whose shapes follow the block
table's width only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.attention.cpu_exact import exact_slots, overlay_exact
from kiln.ops.attention.cpu_sdpa import compute_dtype
from kiln.ops.attention.paged_decode_attention import cpu_native
from kiln.ops.attention.paged_decode_attention.spec import PAGED_DECODE_ATTENTION
from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.realize import realized
from kiln.ops.registry import Implementation, cpu_only


def _decode_batched(
    q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale,
    exact=None,
):  # fmt: skip
    """All sequences at once, padded to the longest context, one SDPA call with a key-padding mask.
    exact: (exact_key_cache, exact_value_cache, exact_block_tables, exact_window) of an fp8 cache's
    exact positions, laid over the gathered keys and values before they are scaled (cpu_exact).

    Measured (SmolLM2 9:3 heads, head_dim 64, one thread, best of 60, shared machine so +-30%):
    fp32 batch 1: 0.05 / 0.09 / 0.29 ms at context 128 / 512 / 2048, same as a per-sequence SDPA
    loop or explicit matmuls; batch 16 (ragged contexts): 0.24 / 1.05 ms at 128 / 512 against
    0.57 / 1.5 ms for the loop. bf16 inputs: the same call in float32 (the gather converts) is
    3-15x faster than bf16 SDPA with a mask, so half inputs compute in float32 too."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    lens = seq_lens
    lens_list = lens.tolist()
    longest = max(lens_list)
    num_blocks = -(-longest // block_size)
    if num_seqs == 1:  # one sequence reads exactly its own blocks: no padding entries to clamp
        blocks = block_tables[0, :num_blocks]
    else:  # padding entries may hold anything: clamp them into range; what they gather is zeroed below
        blocks = block_tables[:, :num_blocks].long().clamp(0, key_cache.shape[0] - 1).reshape(-1)
    dtype = compute_dtype(q)
    # A sequence shorter than the longest gathers slots past its length, which the contract never
    # reads and which may hold anything, NaN included. Masking the scores is not enough (SDPA adds
    # the mask to a NaN score, and probability 0 times a NaN value is NaN), so they are zeroed: one
    # fill per short sequence (10-30x cheaper than a boolean-mask write over the batch; measured
    # +0.1 ms at batch 16 / context 128, within noise at context 512). A single sequence gathers
    # exactly its own tokens: nothing to zero, the path is unchanged.
    short = [(b, length) for b, length in enumerate(lens_list) if length < longest]
    if exact is not None:
        exact_mask, slots = exact_slots(exact[2], lens, longest, block_size, exact[3])

    def gather(cache, cache_scale, exact_cache=None):
        tokens = cache.index_select(0, blocks).view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
        tokens = tokens[:, :longest].to(dtype)
        if exact_cache is not None:
            tokens = overlay_exact(tokens, exact_cache, exact_mask, slots)
        if cache_scale is not None:
            tokens = tokens * cache_scale.to(dtype)[:, None]
        for b, length in short:  # tokens is this call's own gathered copy
            tokens[b, length:] = 0
        return tokens.transpose(1, 2)  # [B, Hkv, L, D]

    k = gather(key_cache, k_scale, None if exact is None else exact[0])
    v = gather(value_cache, v_scale, None if exact is None else exact[1])
    scale = head_dim**-0.5 if scale is None else scale
    group = num_heads // num_kv_heads
    # One sequence without a window sees every gathered key: no mask, SDPA's faster unmasked path
    # (and none of the mask's small ops, ~20 us a call at batch 1).
    unmasked = num_seqs == 1 and sliding_window is None
    if not unmasked or softcap is not None:
        positions = torch.arange(longest, device=q.device)[None, :]
        visible = positions < lens[:, None]
        if sliding_window is not None:
            visible &= positions > lens[:, None] - 1 - sliding_window
    if softcap is None:
        mask = None if unmasked else visible[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.to(dtype).view(num_seqs, num_heads, 1, head_dim),
            k,
            v,
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.view(num_seqs, num_heads, head_dim).to(q.dtype)
    # Soft-capping needs the scores: [B, Hkv, G, D] @ [B, Hkv, D, L] per GQA group.
    scores = (
        torch.matmul(q.to(dtype).view(num_seqs, num_kv_heads, group, head_dim), k.transpose(2, 3)) * scale
    )
    scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(~visible[:, None, None, :], -math.inf)
    out = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


# The in-graph form was measured faster than the eager one up to here (SmolLM2 heads, 2 threads, per
# call, two runs: batch 1 at 2048 / 8192 positions 0.32 / 0.81 ms against 0.41-0.61 / 2.3-5.1 ms;
# batch 16 at 1024 1.5 against 10.3-11.7 ms); longer block tables keep the opaque node (a second
# graph per batch size).
IN_GRAPH_MAX_CONTEXT = 8192


def _decode_in_graph(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window):
    """The attention as plain tensor code a compiled graph holds: every entry of block_tables is
    gathered (out-of-range ones clamped), slots at or past a sequence's length are masked (scores) and
    zeroed (values). Its cost follows block_tables' width, so the caller passes the table cut to the
    longest context (the compiled step marks that width dynamic: one graph serves every context up to
    IN_GRAPH_MAX_CONTEXT).

    Written as broadcast products and sums, not SDPA: inductor fuses the gather, both contractions
    and the softmax into one C++ kernel that reads each key and value once from the cache. SDPA's CPU
    kernel is slow for one query row (SmolLM2 heads, 2 threads, per call, against the SDPA form this
    replaced: batch 1 / context 208 91 -> 69 us, batch 16 / 208 349 -> 288 us, batch 16 / 1024
    10.7 -> 1.5 ms)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    lens = seq_lens.long()[:, None]
    positions = torch.arange(width, device=q.device)[None, :]
    visible = positions < lens  # [B, L]
    if sliding_window is not None:
        visible = visible & (positions > lens - 1 - sliding_window)
    blocks = block_tables.long().clamp(0, key_cache.shape[0] - 1)
    dtype = compute_dtype(q)

    def gather(cache):  # [B, Hkv, L, D]
        return cache[blocks].view(num_seqs, width, num_kv_heads, head_dim).permute(0, 2, 1, 3).to(dtype)

    scale = head_dim**-0.5 if scale is None else scale
    # realized: the queries computed once into a buffer; as plain code inductor inlines their producer
    # (RoPE) into the score loop, once per key.
    queries = realized(q.to(dtype).reshape(num_seqs * num_heads, head_dim)) * scale
    queries = queries.view(num_seqs, num_kv_heads, group, 1, head_dim)
    scores = (queries * gather(key_cache).unsqueeze(2)).sum(-1)  # [B, Hkv, G, L]
    # masked_fill, not an added mask: a slot past the length may hold NaN, and NaN + -inf is NaN
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1)
    values = torch.where(visible[:, None, :, None], gather(value_cache), 0)  # 0 * NaN would be NaN
    out = (probs.unsqueeze(-1) * values.unsqueeze(2)).sum(3)  # [B, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _native(q, key_cache, softcap) -> bool:
    """Whether the native kernel (cpu_native) serves this call: built, head dim instantiated, a float
    or float8_e4m3fn cache (its scales and exact positions included), no soft-capping."""
    return softcap is None and cpu_native.ready(q.shape[-1], key_cache.dtype)


def _traceable(
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    scale=None,
    sliding_window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    exact_key_cache=None,
    exact_value_cache=None,
    exact_block_tables=None,
    exact_window=0,
) -> bool:
    """Float caches without soft-capping are read in-graph up to IN_GRAPH_MAX_CONTEXT gathered
    positions; the rest stay one opaque node. Evaluated while tracing, the width test is a guard on
    the block table's dynamic width: a longer context compiles a second graph with the opaque node.
    The native kernel, when loaded, is one node of the graph at any context."""
    if _native(q, key_cache, softcap):
        return True
    if softcap is not None or key_cache.dtype in FP8_DTYPES:
        return False
    return block_tables.shape[1] * key_cache.shape[1] <= IN_GRAPH_MAX_CONTEXT


def paged_decode_attention_cpu(
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
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
    if not torch.compiler.is_compiling():
        if q.shape[0] == 0:
            return torch.empty_like(q)
        cpu_native.load()  # once per process; while tracing, the compiled step has loaded it already
    if _native(q, key_cache, softcap):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if key_cache.dtype in FP8_DTYPES:
            return cpu_native.paged_decode_fp8(
                q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, k_scale, v_scale,
                exact_key_cache, exact_value_cache, exact_block_tables, exact_window,
            )  # fmt: skip
        return cpu_native.paged_decode(
            q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window
        )
    if torch.compiler.is_compiling():  # only reached when _traceable says so (kiln.ops.registry)
        return _decode_in_graph(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window)
    exact = None
    if exact_block_tables is not None:
        exact = (exact_key_cache, exact_value_cache, exact_block_tables, exact_window)
    return _decode_batched(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale,
        exact,
    )  # fmt: skip


PAGED_DECODE_ATTENTION.register(
    Implementation("cpu", paged_decode_attention_cpu, cpu_only, traceable=_traceable)
)
