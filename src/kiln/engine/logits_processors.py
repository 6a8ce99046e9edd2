"""The adjustments a request's SamplingParams make to its logits before the sampler tempers, filters and
draws: min_tokens, logit_bias and the repetition, frequency and presence penalties, in vLLM's order.

Per row of a batch whose request sets any of them (SamplingParams.adjusts_logits), with l the row's
logits, c[v] how many times token v occurs in the output so far and s[v] whether v occurs in the
prompt or the output so far:

    min_tokens   l[v] = -inf for EOS and stop_token_ids while the output is shorter than min_tokens
    logit_bias   l[v] += bias[v]
    repetition   l[v] = l[v] / r if l[v] > 0 else l[v] * r, where s[v] (transformers' and vLLM's form
                 of the CTRL penalty)
    frequency    l[v] -= frequency_penalty * c[v]
    presence     l[v] -= presence_penalty * (c[v] > 0)      (the last two: OpenAI's formula)

Rows of other requests are returned as they came, bit for bit, and a batch without such a row costs one
pass over its params. The token lists reach the device in one copy (kiln.engine.host_upload). A
sequence's tokens are read at each step (output and prompt ids: O(length) host work a step for the
rows that ask for a penalty). Speculative decoding does not run for these requests (the scheduler gives
them no proposal slots): their verify step would need the penalties at every proposed position.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.engine.host_upload import upload
from kiln.engine.sequence import Sequence


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab] (any float dtype), row i the next-token logits of seqs[i] (whose next token is
    output token number seqs[i].num_output_tokens). Returns `logits` itself when no request adjusts its
    logits, else a float32 copy with the adjusted rows replaced (the others unchanged)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    device = logits.device
    arrays = [np.array(rows, dtype=np.int64)] + _host_arrays([seqs[i] for i in rows])
    (
        row_index, bias_at, bias_ids, bias, banned_at, banned_ids, out_at, out_ids, seen_at, seen_ids,
        repetition, frequency, presence,
    ) = upload(device, arrays)  # fmt: skip
    repetition, frequency, presence = repetition[:, None], frequency[:, None], presence[:, None]
    adjusted = logits.float().index_select(0, row_index)
    adjusted.index_put_((bias_at, bias_ids), bias, accumulate=True)
    adjusted.index_put_((banned_at, banned_ids), torch.tensor(float("-inf"), device=device))
    counts = torch.zeros_like(adjusted)
    counts.index_put_((out_at, out_ids), torch.ones_like(out_at, dtype=counts.dtype), accumulate=True)
    seen = counts > 0
    seen.index_put_((seen_at, seen_ids), torch.tensor(True, device=device))
    # rows at repetition 1 come out as they went in: x / 1 and x * 1 are x
    adjusted = torch.where(
        seen, torch.where(adjusted > 0, adjusted / repetition, adjusted * repetition), adjusted
    )
    adjusted = adjusted - frequency * counts - presence * (counts > 0)
    return logits.float().index_copy(0, row_index, adjusted)


def _host_arrays(seqs: list[Sequence]) -> list[np.ndarray]:
    """For the adjusted rows seqs (row r = seqs[r]), as (row, token id) pairs: the logit biases and
    their values, the tokens min_tokens bans now, the output tokens (repeats included) of rows with a
    penalty, the prompt tokens of rows with a repetition penalty; then each row's repetition, frequency
    and presence penalties."""
    bias_at: list[int] = []
    bias_ids: list[int] = []
    bias: list[float] = []
    banned_at: list[int] = []
    banned_ids: list[int] = []
    out_at: list[int] = []
    out_ids: list[int] = []
    seen_at: list[int] = []
    seen_ids: list[int] = []
    for r, seq in enumerate(seqs):
        params = seq.params
        if params.logit_bias:
            bias_at += [r] * len(params.logit_bias)
            bias_ids += params.logit_bias.keys()
            bias += params.logit_bias.values()
        if seq.num_output_tokens < params.min_tokens:
            banned_at += [r] * len(seq.min_tokens_stop_ids)
            banned_ids += seq.min_tokens_stop_ids
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
            outputs = seq.token_ids[seq.num_prompt_tokens :]
            out_at += [r] * len(outputs)
            out_ids += outputs
        if params.repetition_penalty != 1.0:
            seen_at += [r] * seq.num_prompt_tokens
            seen_ids += seq.token_ids[: seq.num_prompt_tokens]
    ids = [bias_at, bias_ids, None, banned_at, banned_ids, out_at, out_ids, seen_at, seen_ids]
    arrays = [np.array(bias, dtype=np.float32) if v is None else np.array(v, dtype=np.int64) for v in ids]
    for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        arrays.append(np.array([getattr(seq.params, name) for seq in seqs], dtype=np.float32))
    return arrays
