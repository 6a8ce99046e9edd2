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
from kiln.engine.decode_buffers import DecodeBuffers, graph_batch_sizes
from kiln.models.attention_metadata import AttentionMetadata

__all__ = ["DecodeGraphs", "graph_batch_sizes"]


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
        self.buffers = buffers = DecodeBuffers(
            self.sizes[-1], runner.max_model_len, runner.block_size, device, runner.exact_kv
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
                metadata = buffers.metadata(bs)
                args = (buffers.input_ids[:bs], buffers.positions[:bs], runner.kv_caches, metadata)
                model.forward(*args)  # warm-up: lazy inits and autotuning happen outside the capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[bs] = model.forward(*args)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.buffers.fill(input_ids, positions, metadata, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
