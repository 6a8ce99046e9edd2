"""ModelRunner: turns a scheduled batch into one flat model call and samples the next tokens.

All tokens of a step go through the model as one flat batch (no padding between sequences), laid
out sequence by sequence and described by one AttentionMetadata. Logits are computed only for the
last scheduled token of each sequence whose prefill is complete with this step. On CUDA, decode-only
steps replay CUDA graphs captured for padded batch sizes 1, 2, 4, 8, 16, 32, 64, ...
"""

from __future__ import annotations

import logging

import torch

from kiln.engine.sampler import Sampler
from kiln.engine.scheduler import ScheduledBatch
from kiln.models.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns the model, its paged KV cache and the sampler.

    kv_caches: per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    of model.kv_cache_dtype on the model's device.
    """

    def __init__(
        self,
        model,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool = False,
        seed: int = 0,
    ):
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_model_len = max_model_len
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        dtype = model.kv_cache_dtype
        # zeros, not empty: masked-out lanes of a partly filled block must not hold NaN bit patterns
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler(device, seed)
        self.graphs = None
        if device.type == "cuda" and not enforce_eager:
            from kiln.engine.cuda_graphs import DecodeGraphs

            try:
                self.graphs = DecodeGraphs(self, max_num_seqs)
            except Exception as exc:  # capture needs every op to be graph-safe; eager still works
                logger.warning("CUDA graph capture failed (%s); running eagerly", exc)
                self.graphs = None

    def prepare(self, batch: ScheduledBatch):
        """Flatten the batch: input_ids int64 [T], positions int64 [T], AttentionMetadata, and the
        row indices (into the T tokens) whose logits are needed, with their sequences."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        cu_seqlens_q = [0]
        sample_rows: list[int] = []
        sample_seqs = []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + n
            table = seq.block_table
            if n == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slot_mapping.append(table[start // size] * size + start % size)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                for b in range(start // size, (end - 1) // size + 1):
                    base = table[b] * size - b * size  # slot of position p in block b is base + p
                    slot_mapping.extend(range(base + max(start, b * size), base + min(end, (b + 1) * size)))
            seq_lens.append(end)
            cu_seqlens_q.append(cu_seqlens_q[-1] + n)
            if end == seq.num_tokens:
                sample_rows.append(cu_seqlens_q[-1] - 1)
                sample_seqs.append(seq)
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        dev = self.device
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64).to(dev, non_blocking=True),
            block_tables=torch.tensor(block_tables, dtype=torch.int32).to(dev, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev, non_blocking=True),
            cu_seqlens_q=torch.tensor(cu_seqlens_q, dtype=torch.int32).to(dev, non_blocking=True),
            max_seqlen_q=max(batch.num_tokens),
            max_seqlen_k=max(seq_lens),
            decode_only=all(n == 1 for n in batch.num_tokens),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.tensor(positions, dtype=torch.int64).to(dev, non_blocking=True)
        return ids, pos, metadata, sample_rows, sample_seqs

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int | None], list[dict[int, float] | None]]:
        """One model step. Returns, per scheduled seq, its new token (None while its prefill is still
        incomplete) and its logprobs entry (None unless requested)."""
        input_ids, positions, metadata, sample_rows, sample_seqs = self.prepare(batch)
        if self.graphs is not None and metadata.decode_only and self.graphs.fits(len(batch)):
            hidden = self.graphs.run(input_ids, positions, metadata)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, metadata)
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[dict[int, float] | None] = [None] * len(batch)
        if not sample_seqs:
            return tokens, logprobs
        if len(sample_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, device=hidden.device)]
        logits = self.model.compute_logits(hidden)
        sampled, sampled_logprobs = self.sampler(logits, sample_seqs)
        where = {id(seq): i for i, seq in enumerate(batch.seqs)}
        for seq, token, lp in zip(sample_seqs, sampled, sampled_logprobs, strict=True):
            tokens[where[id(seq)]] = token
            logprobs[where[id(seq)]] = lp
        return tokens, logprobs
