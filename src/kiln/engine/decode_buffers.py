"""Static decode-step inputs padded to a batch-size bucket, shared by the CUDA graphs
(`engine/cuda_graphs.py`) and the compiled CPU decode step (`engine/cpu_compiled_step.py`): a
captured or compiled step reads fixed buffers, so each step copies its real inputs in and pads the
rest (slot -1: write nothing; seq_len 1 on block 0: read one harmless slot).
"""

from __future__ import annotations

import torch

from kiln.engine.exact_kv import ExactKVLayout
from kiln.models.attention_metadata import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first size that holds max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    cut = next(i for i, s in enumerate(sizes) if s >= max_num_seqs)
    return sizes[: cut + 1]


class DecodeBuffers:
    """input_ids, positions, slot_mapping [max_bs]; block_tables [max_bs, max_blocks];
    seq_lens [max_bs]; cu_seqlens_q [max_bs + 1] (one query per sequence), on `device`. With
    `exact_kv` (an fp8 cache's exact positions): exact_slot_mapping [max_bs] and exact_block_tables
    [max_bs, 1 + ring_blocks] too (padding: slot -1, exact block 0), else those are None."""

    def __init__(
        self,
        max_bs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        exact_kv: ExactKVLayout | None = None,
    ):
        max_blocks = -(-max_model_len // block_size)
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.exact_window = 0 if exact_kv is None else exact_kv.window
        self.exact_slot_mapping = self.exact_block_tables = None
        if exact_kv is not None:
            self.exact_slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
            self.exact_block_tables = torch.zeros(
                max_bs, 1 + exact_kv.ring_blocks, dtype=torch.int32, device=device
            )

    def fill(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, bs: int
    ) -> None:
        """Copy a decode step of n = len(input_ids) <= bs sequences into the first n rows and pad
        rows n..bs-1."""
        n = input_ids.shape[0]
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:bs].zero_()
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if self.exact_block_tables is not None:
            self.exact_slot_mapping[:n].copy_(metadata.exact_slot_mapping)
            self.exact_slot_mapping[n:bs].fill_(-1)
            self.exact_block_tables[:n].copy_(metadata.exact_block_tables)
            self.exact_block_tables[n:bs].zero_()

    def metadata(self, bs: int) -> AttentionMetadata:
        """The decode metadata over the first bs rows; max_seqlen_k is the constant max_model_len
        (a captured or compiled step fixes every launch's grid)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.max_model_len,
            decode_only=True,
            exact_block_tables=None if self.exact_block_tables is None else self.exact_block_tables[:bs],
            exact_slot_mapping=None if self.exact_slot_mapping is None else self.exact_slot_mapping[:bs],
            exact_window=self.exact_window,
        )
