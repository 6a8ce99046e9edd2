"""Split one step's flat batch (ModelInputs) into micro-batches of whole sequences for the pipeline.

Sequence i of a step owns tokens cu_seqlens_q[i]:cu_seqlens_q[i + 1]; a micro-batch is a contiguous
run of sequences, so its tokens, slots, block-table rows and sample rows are contiguous slices of the
step's, rebased to start at 0. Attention never mixes sequences, so running the micro-batches one after
another computes what the whole batch computes. Every rank splits the same broadcast inputs with the
same rule, so the stages agree on the micro-batches without another message.
"""

from __future__ import annotations

import dataclasses

from kiln.engine.model_runner import ModelInputs


def micro_batch_bounds(cu_seqlens_q: list[int], count: int) -> list[tuple[int, int]]:
    """Sequence ranges [s0, s1) of min(count, num_seqs) non-empty micro-batches whose token counts are
    as even as the sequence boundaries allow (a boundary at the first sequence reaching k * T / count)."""
    num_seqs = len(cu_seqlens_q) - 1
    count = max(1, min(count, num_seqs))
    total = cu_seqlens_q[-1]
    bounds, start = [], 0
    for k in range(1, count):
        target = k * total / count
        end = start + 1
        while end < num_seqs - (count - k) and cu_seqlens_q[end] < target:
            end += 1
        bounds.append((start, end))
        start = end
    bounds.append((start, num_seqs))
    return bounds


def split_micro_batches(inputs: ModelInputs, count: int) -> list[ModelInputs]:
    """`inputs` as up to `count` micro-batches of whole sequences, in order (see micro_batch_bounds);
    [inputs] itself when count <= 1 or the batch has one sequence. The micro-batches' sample rows,
    concatenated in order, are the step's sample rows. The step's exact_fill is not split: the caller
    copies it before running any micro-batch."""
    metadata = inputs.attn_metadata
    cu = [int(x) for x in metadata.cu_seqlens_q.tolist()]
    bounds = micro_batch_bounds(cu, count)
    if len(bounds) == 1:
        return [inputs]
    out = []
    for s0, s1 in bounds:
        t0, t1 = cu[s0], cu[s1]
        q_lens = [cu[i + 1] - cu[i] for i in range(s0, s1)]
        seq_lens = metadata.seq_lens[s0:s1]
        part = dataclasses.replace(
            metadata,
            slot_mapping=metadata.slot_mapping[t0:t1],
            block_tables=metadata.block_tables[s0:s1],
            seq_lens=seq_lens,
            cu_seqlens_q=metadata.cu_seqlens_q[s0 : s1 + 1] - t0,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=int(seq_lens.max()),
            decode_only=all(n == 1 for n in q_lens),
        )
        if metadata.exact_block_tables is not None:
            part.exact_block_tables = metadata.exact_block_tables[s0:s1]
            part.exact_slot_mapping = metadata.exact_slot_mapping[t0:t1]
        rows = [r - t0 for r in inputs.sample_rows if t0 <= r < t1]
        out.append(ModelInputs(inputs.input_ids[t0:t1], inputs.positions[t0:t1], part, rows))
    return out
