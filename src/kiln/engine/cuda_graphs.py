"""CUDA graphs for decode steps: one graph per padded batch size, captured once, replayed per step.

A decode step of a small model is dominated by kernel launch overhead; a captured graph replays
all of the step's kernels in one launch. Inputs live in static buffers that each replay reads, so
a step copies its real inputs in and pads the rest (slot -1: write nothing; seq_len 1 on block 0:
read one harmless slot). Only used on CUDA (not testable on the CPU-only CI machine).

A capture that fails is recorded in kiln.fallbacks (CUDA_GRAPH_TO_EAGER) before the error reaches
ModelRunner, which then decodes eagerly: a benchmark of that engine must not be reported as graphed.
"""

from __future__ import annotations

import torch

from kiln import fallbacks
from kiln.models.attention_metadata import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to the first size that holds max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    cut = next(i for i, s in enumerate(sizes) if s >= max_num_seqs)
    return sizes[: cut + 1]


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int):
        try:
            self._capture(runner, max_num_seqs)
        except Exception as exc:  # the caller runs eagerly: say so where results are written
            detail = f"DecodeGraphs(max_num_seqs={max_num_seqs}): {exc!r}"
            fallbacks.record(fallbacks.CUDA_GRAPH_TO_EAGER, detail)
            raise

    def _capture(self, runner, max_num_seqs: int) -> None:
        self.runner = runner
        model = runner.model
        device = runner.device
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
                metadata = self._metadata(bs)
                args = (self.input_ids[:bs], self.positions[:bs], runner.kv_caches, metadata)
                model.forward(*args)  # warm-up: lazy inits and autotuning happen outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = model.forward(*args)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            block_tables=self.block_tables[:bs],
            seq_lens=self.seq_lens[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            max_seqlen_q=1,
            max_seqlen_k=self.runner.max_model_len,  # a constant: the graph fixes every launch's grid
            decode_only=True,
        )

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        width = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        self.block_tables[:bs].zero_()
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
