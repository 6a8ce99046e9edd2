"""Self-attention over the paged KV cache: fused QKV projection, RoPE, cache write, paged attention.

Per step: qkv = x @ Wqkv^T (+ b); rotate q and k in place; write this step's k, v into the cache at
attn_metadata.slot_mapping; then attend to the whole context from the cache (paged_decode_attention
when every sequence has one new token, else paged_prefill_attention, which covers chunked prefill
and mixed batches); o_proj.

Under tensor parallelism the layer is built with this rank's head counts (whole GQA groups, see
kiln.models.sharding): qkv_proj is column-parallel over its heads' rows, o_proj row-parallel over
their columns (summed over the ranks); the KV cache holds only this rank's kv heads.
"""

from __future__ import annotations

import torch

import kiln.ops
from kiln.models.attention_metadata import AttentionMetadata
from kiln.models.layer_kv_cache import LayerKVCache
from kiln.models.layers.linear import Linear
from kiln.models.layers.parallel_linear import RowParallelLinear
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.models.layers.tp import TPGroup
from kiln.models.weights import Weight, cat_rows

FP16_MAX = 65504.0  # float16's largest finite value


def fp8_units(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] in an fp8 cache's units, for its exact caches: float16 x / scale, saturated only at
    float16's +-65504 (146x e4m3's +-448). Not at 448 as the fp8 values are: a key or value beyond
    448 * scale (past the calibration's headroom) must stay exact at an exact position, which is what
    the exact window promises (the fp8 cache keeps its saturated copy for when it leaves the window)."""
    return (x.float() / scale.float()[None, :, None]).clamp(-FP16_MAX, FP16_MAX).to(torch.float16)


class PagedAttention(torch.nn.Module):
    """hidden [T, hidden] -> [T, hidden].

    num_heads, num_kv_heads: this rank's (all of them in one process); q [num_heads * head_dim, hidden],
    k and v [num_kv_heads * head_dim, hidden], o [hidden, num_heads * head_dim]: this rank's slices.
    kv_cache: a kiln.models.layer_kv_cache.LayerKVCache (or a plain (key_cache, value_cache) pair),
    caches [num_blocks, block_size, num_kv_heads, head_dim]; this step's keys and values are written
    into it in place. A cache of another float dtype than the activations (a 16-bit cache under a
    float32 model) gets q, k and v rounded to its dtype; the output returns in the activations'
    dtype. A float8_e4m3fn cache comes with its scales (stored = value / scale), optionally a key
    shift subtracted from every key before it is stored (softmax is unchanged by it;
    kiln.engine.kv_scales) and optionally exact caches: this step's keys and values also go there
    unrounded (float16, in the fp8 cache's units) at attn_metadata.exact_slot_mapping, and attention
    reads each sequence's first block and last attn_metadata.exact_window positions from them.
    scale: the attention scores' scale (None = head_dim ** -0.5; Gemma 3: query_pre_attn_scalar ** -0.5).
    qk_norm: (q_weight, k_weight), each [head_dim]: RMSNorm every q and k head (eps `qk_norm_eps`)
    before RoPE, fused with it in `kiln.ops.qk_norm_rope` (Qwen3); None = RoPE only.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q: Weight,
        k: Weight,
        v: Weight,
        o: Weight,
        qkv_bias: list[torch.Tensor] | None,
        rotary: RotaryEmbedding,
        sliding_window: int | None,
        device: torch.device,
        dtype: torch.dtype,
        cpu_format: str | None = None,
        tp_group: TPGroup | None = None,
        scale: float | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm_eps: float = 1e-6,
        o_bias: torch.Tensor | None = None,
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        bias = None if qkv_bias is None else torch.cat([b.float() for b in qkv_bias])
        self.qkv_proj = Linear(
            cat_rows([q, k, v], dtype), bias, device=device, dtype=dtype, cpu_format=cpu_format
        )
        self.o_proj = RowParallelLinear(
            o,
            None if o_bias is None else o_bias.float(),
            device=device,
            dtype=dtype,
            cpu_format=cpu_format,
            tp_group=tp_group,
        )
        self.rotary = rotary
        self.scale = head_dim**-0.5 if scale is None else scale
        self.qk_norm, self.qk_norm_eps = qk_norm, qk_norm_eps
        self.sliding_window = sliding_window

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: LayerKVCache | tuple[torch.Tensor, ...],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm is None:
            q, k = self.rotary(positions, q, k)
        else:
            q_weight, k_weight = self.qk_norm
            q, k = kiln.ops.qk_norm_rope(
                positions, q, k, q_weight, k_weight, self.rotary.cos_sin_cache, self.qk_norm_eps, True
            )
        cache = kv_cache if isinstance(kv_cache, LayerKVCache) else LayerKVCache(*kv_cache)
        key_cache, value_cache, k_scale, v_scale, k_shift = cache[:5]
        if k_shift is not None:
            # Every key minus one fixed vector per head: q.(k - s) = q.k - q.s shifts all of a query's
            # scores by the same amount, which softmax ignores; centred keys round finer in fp8.
            k = k - k_shift.to(k.dtype)
        out_dtype = q.dtype
        if k_scale is None and key_cache.dtype != q.dtype:
            # A 16-bit cache under a float32 model (EngineConfig.kv_cache_dtype): the ops take one
            # dtype, so this step's q, k and v round to the cache's and the output comes back below.
            q, k, v = q.to(key_cache.dtype), k.to(key_cache.dtype), v.to(key_cache.dtype)
        kiln.ops.write_kv_cache(k, v, key_cache, value_cache, attn_metadata.slot_mapping, k_scale, v_scale)
        exact_args = {}
        if cache.exact_key_cache is not None:
            kiln.ops.write_kv_cache(
                fp8_units(k, k_scale),
                fp8_units(v, v_scale),
                cache.exact_key_cache,
                cache.exact_value_cache,
                attn_metadata.exact_slot_mapping,
            )
            exact_args = {
                "exact_key_cache": cache.exact_key_cache,
                "exact_value_cache": cache.exact_value_cache,
                "exact_block_tables": attn_metadata.exact_block_tables,
                "exact_window": attn_metadata.exact_window,
            }
        if k_scale is not None and q.device.type != "cpu":
            # The GPU kernels read fp8 pages as float16 next to float16 queries (the combination they
            # are verified in); the CPU kernels compute in float32 whatever q is.
            q = q.to(torch.float16)
        if attn_metadata.decode_only:
            out = kiln.ops.paged_decode_attention(
                q,
                key_cache,
                value_cache,
                attn_metadata.block_tables,
                attn_metadata.seq_lens,
                scale=self.scale,
                sliding_window=self.sliding_window,
                k_scale=k_scale,
                v_scale=v_scale,
                **exact_args,
            )
        else:
            out = kiln.ops.paged_prefill_attention(
                q,
                key_cache,
                value_cache,
                attn_metadata.block_tables,
                attn_metadata.cu_seqlens_q,
                attn_metadata.seq_lens,
                attn_metadata.max_seqlen_q,
                scale=self.scale,
                sliding_window=self.sliding_window,
                k_scale=k_scale,
                v_scale=v_scale,
                **exact_args,
            )
        return self.o_proj(out.to(out_dtype).reshape(num_tokens, self.q_size))
