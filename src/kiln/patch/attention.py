"""kiln.patch's attention: a transformers attention function, registered as attn_implementation
"kiln", that runs kiln.ops.autograd.flash_attention (FlashAttention forward and backward kernels).

transformers calls it as fn(module, query [B, H, S, D], key / value [B, Hkv, S_k, D], attention_mask,
dropout=..., scaling=..., sliding_window=..., **kwargs) and expects (out [B, S, H, D], None). The batch
becomes Kiln's varlen layout: B sequences of S tokens each, cu_seqlens = 0, S, 2S, ..., causal, with
transformers' sliding window (query i sees keys j with i - j < W, the same rule as Kiln's).

Kiln's kernel runs when the mask is None or exactly the causal (+ window) mask of the batch, there is
no dropout, S_k == S (no KV cache) and the head dim is one Kiln supports; any other call (padding in
the mask, a cache, dropout, another head dim) runs transformers' SDPA attention instead, which reads
the same boolean masks (the "kiln" implementation builds its masks with transformers' sdpa_mask).
"""

from __future__ import annotations

import torch

from kiln.ops import autograd as kiln_autograd
from kiln.ops.attention.validate import SUPPORTED_HEAD_DIMS

NAME = "kiln"


def _is_causal_mask(mask: torch.Tensor, seq: int, sliding_window: int | None) -> bool:
    """True when `mask` [B or 1, 1 or H, S, S] (bool: True = attend; float: 0 = attend) is the plain
    causal mask with `sliding_window`, for every batch row and head."""
    if mask.dim() != 4 or mask.shape[-2:] != (seq, seq):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    i = torch.arange(seq, device=mask.device)[:, None]
    j = torch.arange(seq, device=mask.device)[None, :]
    expected = j <= i
    if sliding_window is not None:
        expected &= i - j < sliding_window
    return bool((allowed == expected).all())


def kiln_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over Kiln's FlashAttention (see the module doc)."""
    batch, heads, seq, head_dim = query.shape
    usable = (
        dropout == 0.0
        and key.shape[2] == seq
        and head_dim in SUPPORTED_HEAD_DIMS
        and query.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and (attention_mask is None or _is_causal_mask(attention_mask, seq, sliding_window))
    )
    if not usable:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    kv_heads = key.shape[1]
    q = query.transpose(1, 2).reshape(batch * seq, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * seq, kv_heads, head_dim)
    v = value.transpose(1, 2).reshape(batch * seq, kv_heads, head_dim)
    cu_seqlens = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
    out = kiln_autograd.flash_attention(
        q, k, v, cu_seqlens, cu_seqlens, seq, seq, causal=True, scale=scaling, sliding_window=sliding_window
    )
    return out.view(batch, seq, heads, head_dim), None


def register() -> None:
    """Make "kiln" an attn_implementation transformers knows (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(NAME, kiln_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
