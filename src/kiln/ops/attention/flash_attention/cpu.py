"""Fast CPU flash_attention / flash_attention_with_lse: one fused SDPA call per sequence (prefills are
few), or explicit float32 matmuls with a GQA-grouped view when the scores themselves are needed
(soft-capping, the LSE); see kiln.ops.attention.cpu_sdpa."""

from __future__ import annotations

import torch

from kiln.ops.alloc import empty, empty_like
from kiln.ops.attention.cpu_sdpa import attend_sequence
from kiln.ops.attention.flash_attention.spec import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.registry import Implementation, cpu_only


def _flash_attention_cpu(
    q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sliding_window, softcap, return_lse
):
    out = empty_like(q)
    lse = empty((q.shape[1], q.shape[0]), torch.float32, q.device) if return_lse else None
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        qs, qe, ks, ke = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if qe == qs:
            continue
        o, s = attend_sequence(
            q[qs:qe], k[ks:ke], v[ks:ke], scale, causal, sliding_window, softcap, return_lse
        )
        out[qs:qe] = o
        if return_lse:
            lse[:, qs:qe] = s
    return out, lse


def flash_attention_cpu(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None,
):  # fmt: skip
    out, _ = _flash_attention_cpu(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sliding_window, softcap, False
    )
    return out


def flash_attention_with_lse_cpu(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None,
):  # fmt: skip
    return _flash_attention_cpu(
        q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, sliding_window, softcap, True
    )


FLASH_ATTENTION.register(Implementation("cpu", flash_attention_cpu, cpu_only))
FLASH_ATTENTION_WITH_LSE.register(Implementation("cpu", flash_attention_with_lse_cpu, cpu_only))
