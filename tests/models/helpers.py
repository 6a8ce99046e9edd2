"""Test helpers: run token ids through a Kiln model with a freshly allocated paged KV cache and
single-sequence attention metadata (in production the engine's model_runner builds these, and runs
the model inside `kiln.ops.trusted_inputs()`, as these helpers do)."""

from __future__ import annotations

import torch

import kiln.ops
from kiln.models import AttentionMetadata


class PagedSequence:
    """One sequence's paged KV cache: blocks allocated in a shuffled order (so block-table lookups
    are exercised), grown as tokens are added."""

    def __init__(self, model, max_tokens: int, block_size: int = 16, seed: int = 0):
        c = model.config
        self.block_size = block_size
        num_blocks = (max_tokens + block_size - 1) // block_size + 2
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [
            (
                torch.randn(shape, dtype=model.kv_cache_dtype, device=model.device),
                torch.randn(shape, dtype=model.kv_cache_dtype, device=model.device),
            )
            for _ in range(c.num_layers)
        ]  # random, not zeros: a read of an unwritten slot shows up in the logits
        generator = torch.Generator().manual_seed(seed)
        self.blocks = torch.randperm(num_blocks, generator=generator).to(torch.int32)
        self.model = model
        self.length = 0

    def step(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the next tokens (the whole prompt, a chunk, or one decode token); hidden [len, hidden]."""
        device = self.model.device
        q_len = len(token_ids)
        positions = torch.arange(self.length, self.length + q_len, dtype=torch.int64)
        slots = (
            self.blocks[positions // self.block_size].long() * self.block_size + positions % self.block_size
        )
        seq_len = self.length + q_len
        metadata = AttentionMetadata(
            slot_mapping=slots.to(device),
            block_tables=self.blocks[None, :].to(device),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32, device=device),
            max_seqlen_q=q_len,
            max_seqlen_k=seq_len,
            decode_only=q_len == 1,
        )
        ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
        with kiln.ops.trusted_inputs():
            hidden = self.model(ids, positions.to(device), self.kv_caches, metadata)
        self.length = seq_len
        return hidden


def prompt_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: logits at every position of one prefill."""
    hidden = PagedSequence(model, len(token_ids), block_size).step(token_ids)
    with kiln.ops.trusted_inputs():
        return model.compute_logits(hidden)


def greedy(model, token_ids: list[int], max_new_tokens: int, block_size: int = 16) -> list[int]:
    """Greedy continuation: one prefill, then one decode step per token."""
    seq = PagedSequence(model, len(token_ids) + max_new_tokens, block_size)
    hidden = seq.step(list(token_ids))
    out = []
    for _ in range(max_new_tokens):
        with kiln.ops.trusted_inputs():
            token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if len(out) == max_new_tokens:
            break
        hidden = seq.step([token])
    return out
