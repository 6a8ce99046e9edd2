"""Attention ops over the paged KV cache (spec per op, backends beside them).

Paged KV cache layout (the engine's contract, docs/contracts.md):
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] each; block_size a power
        of two (16 by default); dtype float16 / bfloat16 / float32, or float8_e4m3fn with float32
        k_scale, v_scale [num_kv_heads] (stored = value / scale).
    block_tables: int32 [num_seqs, max_blocks_per_seq]; token t of sequence b lives in block
        block_tables[b, t // block_size] at offset t % block_size (later entries are never read).
    seq_lens: int32 [num_seqs], context length including any new tokens; cache slots at or past a
        sequence's seq_len are never read (they may hold anything).
    slot_mapping: int64 [num_tokens], slot = block * block_size + offset; negative = skip (padding).
Masks: causal is bottom-right aligned (query i of a sequence with q_len queries and k_len keys sees
keys j <= i + k_len - q_len); a sliding window W additionally keeps (i + k_len - q_len) - j < W;
soft-capping replaces scores s by softcap * tanh(s / softcap); the default scale is head_dim ** -0.5.
Head dims: 64, 80, 96, 128, 256. GQA/MQA: query head h reads kv head h // (num_heads // num_kv_heads).

Ops, one folder each (spec.py, then one file per backend: triton.py, cpu.py, pallas_tpu.py,
pallas_gpu.py, xla.py where they exist): write_kv_cache/, flash_attention/ (also
flash_attention_with_lse, the same kernel returning the LSE), flash_attention_backward/ (its
gradients from the saved LSE), paged_prefill_attention/,
paged_decode_attention/. Shared by the family: reference.py (the float64 math every op is checked
against), validate.py (argument checks), paged_inputs.py (input makers), triton_prefill.py (the
FlashAttention-2 Triton kernel behind flash_attention and paged_prefill_attention), cpu_sdpa.py (the
CPU attention of one sequence), jax_common.py (what the JAX backends share).
"""

from kiln.ops.attention.flash_attention import flash_attention, flash_attention_with_lse
from kiln.ops.attention.flash_attention_backward import flash_attention_backward
from kiln.ops.attention.paged_decode_attention import paged_decode_attention
from kiln.ops.attention.paged_prefill_attention import paged_prefill_attention
from kiln.ops.attention.write_kv_cache import write_kv_cache

__all__ = [
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_with_lse",
    "paged_decode_attention",
    "paged_prefill_attention",
    "write_kv_cache",
]
