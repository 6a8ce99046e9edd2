"""Attention ops over the paged KV cache (spec per op, backends beside them).

Paged KV cache layout (the engine's contract, docs/contracts.md):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] each; block_size a power
        of two (16 by default); dtype float16 / bfloat16 / float32, or float8_e4m3fn with float32
        k_scale, v_scale [num_kv_heads] (stored = value / scale).
    block_tables: int32 [num_seqs, max_blocks_per_seq]; token t of sequence b lives in block
        block_tables[b, t // block_size] at offset t % block_size (later entries are never read).
    seq_lens: int32 [num_seqs], context length including any new tokens.
    slot_mapping: int64 [num_tokens], slot = block * block_size + offset; negative = skip (padding).
Masks: causal is bottom-right aligned (query i of a sequence with q_len queries and k_len keys sees
keys j <= i + k_len - q_len); a sliding window W additionally keeps (i + k_len - q_len) - j < W;
soft-capping replaces scores s by softcap * tanh(s / softcap); the default scale is head_dim ** -0.5.
Head dims: 64, 80, 96, 128, 256. GQA/MQA: query head h reads kv head h // (num_heads // num_kv_heads).

Ops: write_kv_cache (kv_cache.py), flash_attention (flash.py), paged_prefill_attention
(paged_prefill.py), paged_decode_attention (paged_decode.py). Backends: prefill_triton.py (the
FlashAttention-2 kernel behind flash_attention and paged_prefill_attention), paged_decode_triton.py
(flash-decoding), kv_cache_triton.py, cpu.py (PyTorch SDPA paths).
"""

from kiln.ops.attention import cpu, kv_cache_triton, paged_decode_triton, prefill_triton  # noqa: F401
from kiln.ops.attention.flash import flash_attention
from kiln.ops.attention.kv_cache import write_kv_cache
from kiln.ops.attention.paged_decode import paged_decode_attention
from kiln.ops.attention.paged_prefill import paged_prefill_attention

__all__ = ["flash_attention", "paged_decode_attention", "paged_prefill_attention", "write_kv_cache"]
