"""Triton paged_prefill_attention: the FlashAttention-2 kernel of kiln.ops.attention.triton_prefill
reading K/V from the paged cache through block_tables (its tiling is described there). An fp8 cache
with exact positions launches its `_paged_prefill_exact_kernel` (the same program, HAS_EXACT): tiles
holding a sequence's first block or its last exact_window positions take those keys and values from
the float16 exact caches; every other tile costs one scalar comparison more."""

from __future__ import annotations

from kiln.ops.attention.paged_prefill_attention.spec import PAGED_PREFILL_ATTENTION, paged_prefill_tune_shape
from kiln.ops.attention.triton_prefill import heuristic_config, launch_prefill, prefill_configs
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.tuned_configs import lookup


def paged_prefill_attention_triton(
    q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
    sliding_window=None, softcap=None, k_scale=None, v_scale=None, exact_key_cache=None,
    exact_value_cache=None, exact_block_tables=None, exact_window=0, config=None,
):  # fmt: skip
    if config is None:
        shape = paged_prefill_tune_shape(q, key_cache, block_tables, max_seqlen_q)
        config = lookup("paged_prefill_attention", q.dtype, shape) or heuristic_config(
            q.shape[-1], max_seqlen_q
        )
    exact = None
    if exact_block_tables is not None:
        exact = (exact_key_cache, exact_value_cache, exact_block_tables, exact_window)
    out, _ = launch_prefill(
        q, key_cache, value_cache, cu_seqlens_q, None, seq_lens, block_tables, k_scale, v_scale, max_seqlen_q,
        True, scale, sliding_window, softcap, False, True, config, exact,
    )  # fmt: skip
    return out


PAGED_PREFILL_ATTENTION.register(
    Implementation("triton", paged_prefill_attention_triton, triton_available, configs=prefill_configs)
)
