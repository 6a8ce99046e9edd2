"""AttentionMetadata: what every attention layer needs to know about the current batch.

The engine's model_runner builds one per step and passes it to `model.forward` explicitly; every
layer reads the same object (no hidden global context). Tokens of a step are laid out sequence by
sequence: sequence i owns tokens cu_seqlens_q[i]:cu_seqlens_q[i + 1], which are the LAST
q_len_i = cu_seqlens_q[i + 1] - cu_seqlens_q[i] tokens of its seq_lens[i]-long context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Batch layout for paged attention (tensors on the model's device).

    slot_mapping:  int64 [num_tokens]   where each new token's K/V goes in the paged cache
                                        (block * block_size + offset; negative = skip, padding)
    block_tables:  int32 [num_seqs, max_blocks_per_seq]  the cache blocks of each sequence, in order
    seq_lens:      int32 [num_seqs]     context length including this step's tokens
    cu_seqlens_q:  int32 [num_seqs + 1] this step's tokens per sequence, prefix-summed
    max_seqlen_q:  longest q_len in the batch
    max_seqlen_k:  longest seq_len in the batch
    decode_only:   every sequence has exactly one new token (-> paged_decode_attention)
    An fp8 cache with exact positions (kiln.engine.exact_kv) also has:
    exact_block_tables: int32 [num_seqs, 1 + R]  each sequence's exact block of its first block, then
                                        its ring of R exact blocks for the recent window
    exact_slot_mapping: int64 [num_tokens]  where each new token also goes in the exact caches
                                        (negative = not an exact position)
    exact_window:  how many of a sequence's last positions attention reads exactly (0 = none)
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool
    exact_block_tables: torch.Tensor | None = None
    exact_slot_mapping: torch.Tensor | None = None
    exact_window: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
