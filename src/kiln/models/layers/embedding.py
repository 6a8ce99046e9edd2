"""Token embedding and LM head, split over the vocabulary under tensor parallelism.

Rank r owns vocabulary rows [v0, v1) of the embedding table (and of the LM head, tied or not).
  embedding: each rank looks up the ids it owns, writes zeros for the others, and one all-reduce sums
             the ranks' rows (exactly one rank contributes each token's row);
  LM head:   each rank computes logits for its vocabulary slice; they are gathered, in rank order,
             to rank 0, which samples (the other ranks never need full logits).
With `tp_group=None` (one process) the table and the head are whole and nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.models.layers.linear import Linear
from kiln.models.layers.tp import TPGroup, all_reduce, gather_to_first
from kiln.models.weights import GGUFWeight, Weight
from kiln.ops.gemm.cpu_gguf_rows import QTYPE_IDS as ROW_QTYPES
from kiln.ops.gemm.cpu_gguf_rows import gguf_rows
from kiln.ops.gemm.cpu_gguf_rows import load as load_gguf_rows


class VocabParallelEmbedding(torch.nn.Module):
    """input_ids int64 [T] (global ids) -> [T, hidden] in `dtype`. A GGUF-quantized table on the CPU
    keeps its file's blocks and decodes the rows it looks up (kiln.ops.gemm.cpu_gguf_rows: the same
    values as decoding the whole table; a Llama-3-8B's 128256 x 4096 table is 2.1 GB in float32, 0.4
    GB as Q6_K); elsewhere, or for a type without a native decode, the table is dequantized once.

    weight: the table's rows [vocab_end - vocab_start, hidden] this process holds (all of them
    without a tp_group); vocab_start: the first one's id.
    """

    def __init__(
        self,
        weight: Weight,
        *,
        device: torch.device,
        dtype: torch.dtype,
        vocab_start: int = 0,
        tp_group: TPGroup | None = None,
    ):
        super().__init__()
        self.blocks, self.qtype, self.dtype = None, None, dtype
        if isinstance(weight, GGUFWeight) and _keeps_blocks(weight, device):
            self.blocks, self.qtype = weight.data.view(weight.shape[0], -1), weight.qtype
            self.weight = None
            self.num_embeddings, self.embedding_dim = weight.shape
        else:
            if isinstance(weight, GGUFWeight):
                weight = weight.dequantize(torch.float32)
            self.weight = weight.to(device=device, dtype=dtype).contiguous()
            self.num_embeddings, self.embedding_dim = self.weight.shape
        self.vocab_start = vocab_start
        self.vocab_end = vocab_start + self.num_embeddings
        self.tp_group = tp_group

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks is None:
            return F.embedding(ids, self.weight)
        return gguf_rows(self.blocks, ids, self.qtype).to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return self._rows(input_ids)
        local = input_ids - self.vocab_start
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        rows = self._rows(local.masked_fill(outside, 0))
        rows.masked_fill_(outside[:, None], 0.0)
        return all_reduce(rows, self.tp_group)

    def extra_repr(self) -> str:
        group = self.tp_group
        where = "" if group is None else f", rank={group.rank}/{group.world_size}"
        return f"vocab=[{self.vocab_start}, {self.vocab_end}), dim={self.embedding_dim}{where}"


def _keeps_blocks(weight: GGUFWeight, device) -> bool:
    """Whether the embedding keeps `weight`'s blocks: on the CPU, for the types cpu_gguf_rows decodes
    natively, where Kiln's native library runs (the tensor decode of a few rows costs ~25-110 us a
    step, the table's lookup ~3)."""
    return torch.device(device).type == "cpu" and weight.qtype in ROW_QTYPES and load_gguf_rows()


class ParallelLMHead(Linear):
    """hidden [N, hidden] -> logits [N, vocab] on rank 0 (rank order = vocabulary order); the other
    ranks return their local slice [N, v1 - v0] (only rank 0 samples).

    weight: this rank's LM-head rows; vocab_sizes: every rank's slice length (with a tp_group).
    Other arguments as Linear's.
    """

    def __init__(
        self,
        weight: Weight,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_format: str | None = None,
        vocab_sizes: list[int] | None = None,
        tp_group: TPGroup | None = None,
    ):
        super().__init__(weight, None, device=device, dtype=dtype, cpu_format=cpu_format)
        self.vocab_sizes = list(vocab_sizes) if vocab_sizes is not None else [self.out_features]
        self.tp_group = tp_group

    def forward(self, hidden: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        logits = super().forward(hidden, out_dtype)
        if self.tp_group is None:
            return logits
        parts = gather_to_first(logits, self.vocab_sizes, self.tp_group)
        return logits if parts is None else torch.cat(parts, dim=-1)
