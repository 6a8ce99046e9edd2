"""Triton flash_attention / flash_attention_with_lse: the FlashAttention-2 kernel of
kiln.ops.attention.triton_prefill over contiguous varlen K/V (its tiling is described there)."""

from __future__ import annotations

from kiln.ops.attention.flash_attention.spec import (
    FLASH_ATTENTION,
    FLASH_ATTENTION_WITH_LSE,
    flash_tune_shape,
)
from kiln.ops.attention.triton_prefill import heuristic_config, launch_prefill, prefill_configs
from kiln.ops.registry import Implementation, triton_available
from kiln.ops.tuned_configs import lookup


def _flash_attention_triton(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window, softcap,
    return_lse, config,
):  # fmt: skip
    if config is None:
        shape = flash_tune_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal)
        # One kernel behind both ops: the LSE variant takes flash_attention's tuned tiles unless tuned itself.
        config = (
            (return_lse and lookup("flash_attention_with_lse", q.dtype, shape))
            or lookup("flash_attention", q.dtype, shape)
            or heuristic_config(q.shape[-1], max_seqlen_q)
        )
    return launch_prefill(
        q, k, v, cu_seqlens_q, cu_seqlens_k, None, None, None, None, max_seqlen_q, causal, scale,
        sliding_window, softcap, return_lse, False, config,
    )  # fmt: skip


def flash_attention_triton(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None, config=None,
):  # fmt: skip
    out, _ = _flash_attention_triton(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap, False, config,
    )  # fmt: skip
    return out


def flash_attention_with_lse_triton(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None, config=None,
):  # fmt: skip
    return _flash_attention_triton(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap, True, config,
    )  # fmt: skip


FLASH_ATTENTION.register(
    Implementation("triton", flash_attention_triton, triton_available, configs=prefill_configs)
)
FLASH_ATTENTION_WITH_LSE.register(
    Implementation("triton", flash_attention_with_lse_triton, triton_available, configs=prefill_configs)
)
