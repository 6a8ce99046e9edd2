"""PipelineStageRunner: one rank's share of a pipeline-parallel step (every rank runs one).

Each rank holds one stage's decoder layers (LlamaForCausalLM(pipeline_layers=...), its TP shard of
them under TP x PP) and a KV cache for those layers only. A step (the inputs rank 0 broadcast) is split
into micro-batches of whole sequences (kiln.distributed.micro_batches); for micro-batch m a stage

    stage 0:      embed(input_ids_m) -> its layers -> isend (hidden, residual) to the next stage
    middle:       recv (hidden, residual) -> its layers -> isend to the next stage
    last stage:   recv -> its layers -> final norm -> LM head on the sample rows -> logits to rank 0

All receives are posted before any compute and all sends are asynchronous, so while stage s runs
micro-batch m, stage s + 1 runs m - 1: with M micro-batches and P stages a step takes about
(M + P - 1) / M stage-times instead of P. Hidden and residual travel as one [2, T_m, hidden] tensor in
the activation dtype; logits as float32 [rows_m, vocab]. Under TP x PP every TP rank of a stage sends
its (replicated) hidden to the same TP rank of the next stage, and only the last stage's TP rank 0
(which holds the gathered logits) sends them to rank 0.

`stats` accumulates, per rank, the wall time spent computing and blocked in the point-to-point waits
(which includes waiting for the previous stage to finish: the pipeline bubble), for `kiln bench parallel`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import kiln.ops
from kiln.distributed.groups import PipelineGroup
from kiln.distributed.micro_batches import split_micro_batches
from kiln.engine.exact_kv import copy_exact_fill
from kiln.engine.model_runner import ModelInputs, ModelRunner

LOGITS_TAG = 1 << 20  # + micro-batch index; hidden states use the micro-batch index


@dataclass
class _InFlight:
    """A launched step on one rank: its micro-batches' logits (last stage, or rank 0 once received),
    rank 0's pending logits receives (micro-batch, buffer, work), the pending sends (tensor, work; the
    tensor kept alive until sent), and whether this rank returns the step's logits."""

    logits_parts: list
    receives: list
    sends: list
    returns_logits: bool


class PipelineStageRunner(ModelRunner):
    """A ModelRunner whose execute runs this rank's stage of the pipeline (see the module doc).
    Constructed like ModelRunner plus group (this rank's PipelineGroup) and micro_batches (how many
    micro-batches a step is split into at most); always eager (no CUDA graphs / compiled decode)."""

    def __init__(self, *args, group: PipelineGroup, micro_batches: int, **kwargs):
        kwargs.update(enforce_eager=True, compile_cpu_decode=False)
        super().__init__(*args, **kwargs)
        if micro_batches < 1:
            raise ValueError(f"PipelineStageRunner: micro_batches={micro_batches}, expected >= 1")
        self.group = group
        self.micro_batches = micro_batches
        self.stats = {"steps": 0, "compute_s": 0.0, "p2p_wait_s": 0.0, "micro_batches": 0}

    def _wait(self, work) -> None:
        start = time.perf_counter()
        work.wait(timeout=timedelta(seconds=self.group.timeout_s))
        self.stats["p2p_wait_s"] += time.perf_counter() - start

    @torch.inference_mode()
    def execute(self, inputs: ModelInputs) -> torch.Tensor | None:
        """This rank's part of one step: float32 logits [len(sample_rows), vocab] on rank 0 (None when
        no row samples), None elsewhere. Every rank of the world calls it with the same inputs."""
        return self.collect(self.launch(inputs))

    @torch.inference_mode()
    def launch(self, inputs: ModelInputs) -> _InFlight:
        """This rank's compute of one step, its sends posted, and on rank 0 the receives of the step's
        logits posted (in step order, so a later step's sends queue behind them as on the other side);
        `collect` waits for them. Rank 0 (stage 0) can launch the next step while later stages still
        run this one."""
        group, model = self.group, self.model
        if inputs.exact_fill is not None:  # this stage's layers, before any micro-batch reads them
            copy_exact_fill(self.kv_caches, inputs.exact_fill[0], inputs.exact_fill[1])
        micro = split_micro_batches(inputs, self.micro_batches)
        hidden_size, device = model.config.hidden_size, self.device
        pipe = group.pipe_group
        received = []
        if group.prev_rank is not None:  # post every receive up front
            for m, part in enumerate(micro):
                buffer = torch.empty(
                    (2, part.input_ids.shape[0], hidden_size), dtype=model.dtype, device=device
                )
                received.append((buffer, dist.irecv(buffer, group.prev_rank, group=pipe, tag=m)))
        sends = []
        logits_parts: list[torch.Tensor | None] = [None] * len(micro)
        with kiln.ops.trusted_inputs():
            for m, part in enumerate(micro):
                if group.prev_rank is None:
                    hidden, residual = model.embed_tokens(part.input_ids), None
                else:
                    buffer, work = received[m]
                    self._wait(work)
                    hidden, residual = buffer[0], buffer[1]
                start = time.perf_counter()
                hidden, residual = model.forward_layers(
                    part.positions, hidden, residual, self.kv_caches, part.attn_metadata
                )
                if group.next_rank is not None:
                    packed = torch.stack((hidden, residual))
                    if packed.is_cuda:
                        torch.cuda.current_stream().synchronize()
                    sends.append((packed, dist.isend(packed, group.next_rank, group=pipe, tag=m)))
                elif part.sample_rows:
                    rows = part.sample_rows
                    if len(rows) != hidden.shape[0]:
                        index = torch.tensor(rows, device=hidden.device)
                        hidden, residual = hidden[index], residual[index]
                    logits = model.compute_logits(model.final_norm(hidden, residual))
                    if group.sends_logits and group.rank != 0:
                        logits = logits.contiguous()
                        sends.append((logits, dist.isend(logits, 0, group=pipe, tag=LOGITS_TAG + m)))
                    logits_parts[m] = logits
                self.stats["compute_s"] += time.perf_counter() - start
        # rank 0 asks for the logits only after posting its sends (NCCL runs a pair's p2p in order)
        receives = []
        if group.rank == 0 and not group.sends_logits:
            vocab = model.config.vocab_size
            for m, part in enumerate(micro):
                if part.sample_rows:
                    buffer = torch.empty((len(part.sample_rows), vocab), dtype=torch.float32, device=device)
                    work = dist.irecv(buffer, self._logits_source(), group=pipe, tag=LOGITS_TAG + m)
                    receives.append((m, buffer, work))
        self.stats["steps"] += 1
        self.stats["micro_batches"] += len(micro)
        return _InFlight(logits_parts, receives, sends, group.rank == 0 and bool(inputs.sample_rows))

    def collect(self, handle: _InFlight) -> torch.Tensor | None:
        """Wait for a launched step's logits (rank 0) and sends: its logits as `execute` returns them."""
        for m, buffer, work in handle.receives:
            self._wait(work)
            handle.logits_parts[m] = buffer
        for _, work in handle.sends:
            self._wait(work)
        if not handle.returns_logits:
            return None
        return torch.cat([p for p in handle.logits_parts if p is not None])

    def _logits_source(self) -> int:
        return self.group.global_rank(self.group.pp_size - 1, 0)
