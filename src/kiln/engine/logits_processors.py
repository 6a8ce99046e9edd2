"""The adjustments a request's SamplingParams make to its logits before the sampler tempers, filters and
draws: allowed_token_ids, bad_words, min_tokens, logit_bias and the repetition, frequency and presence
penalties, in vLLM's order.

Per row of a batch whose request sets any of them (SamplingParams.adjusts_logits), with l the row's
logits, c[v] how many times token v occurs in the output so far and s[v] whether v occurs in the
prompt or the output so far:

    allowed      l[v] = -inf for every v not in allowed_token_ids
    bad_words    l[v] = -inf for the last token v of a bad word whose other tokens end the output
    min_tokens   l[v] = -inf for EOS and stop_token_ids while the output is shorter than min_tokens
    logit_bias   l[v] += bias[v]
    repetition   l[v] = l[v] / r if l[v] > 0 else l[v] * r, where s[v] (transformers' and vLLM's form
                 of the CTRL penalty)
    frequency    l[v] -= frequency_penalty * c[v]
    presence     l[v] -= presence_penalty * (c[v] > 0)      (the last two: OpenAI's formula)

Rows of other requests are returned as they came, bit for bit, and a batch without such a row costs one
pass over its params. The work is sparse: each adjustment gathers and scatters only the (row, token)
pairs it changes, since dense passes over [rows, vocab] cost milliseconds a step on a CPU (2 Zen 3
cores, 49152 tokens, 16 rows with 32 + 256 tokens: 11.0 ms for the repetition penalty alone, 1.0 ms this
way; all four 22.5 -> 2.3 ms). Each sequence keeps its prompt's distinct tokens and its output counts
(PenaltyHistory), updated with the new tokens only; the pairs reach the device in one copy
(kiln.engine.host_upload). Speculative decoding does not run for these requests (the scheduler gives
them no proposal slots): their verify step would need the penalties at every proposed position.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.engine.host_upload import upload
from kiln.engine.sequence import Sequence


class PenaltyHistory:
    """A sequence's tokens as its penalties read them, kept up to date a step at a time: the distinct
    prompt tokens (sorted int64, for the repetition penalty), and each output token's count."""

    def __init__(self, seq: Sequence):
        self.prompt = np.unique(np.asarray(seq.prompt_token_ids, dtype=np.int64))
        self._prompt_set = set(self.prompt.tolist())
        self.counts: dict[int, int] = {}
        self.new_seen: list[int] = []  # output tokens not in the prompt, each once, in order of arrival
        self._counted = 0

    def update(self, seq: Sequence) -> None:
        """Count the output tokens added since the last call (from scratch if the output shrank)."""
        outputs = seq.token_ids[seq.num_prompt_tokens :]
        if len(outputs) < self._counted:
            self.counts, self.new_seen, self._counted = {}, [], 0
        for token in outputs[self._counted :]:
            if token not in self.counts:
                self.counts[token] = 0
                if token not in self._prompt_set:
                    self.new_seen.append(token)
            self.counts[token] += 1
        self._counted = len(outputs)


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [N, vocab] (any float dtype), row i the next-token logits of seqs[i] (whose next token is
    output token number seqs[i].num_output_tokens). Returns `logits` itself when no request adjusts its
    logits, else a float32 copy with the adjusted rows changed (the others as they were)."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.adjusts_logits]
    if not rows:
        return logits
    (
        allowed_rows, allowed_at, allowed_ids, bias_at, bias_ids, bias, banned_at, banned_ids,
        seen_at, seen_ids, seen_r, count_at, count_ids, counts, frequency, presence,
    ) = upload(logits.device, _host_arrays(seqs, rows))  # fmt: skip
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    if allowed_rows.numel():
        kept = out[allowed_at, allowed_ids]
        out.index_fill_(0, allowed_rows, float("-inf"))
        out[allowed_at, allowed_ids] = kept
    out.index_put_((bias_at, bias_ids), bias, accumulate=True)
    out.index_put_((banned_at, banned_ids), torch.tensor(float("-inf"), device=out.device))
    seen = out[seen_at, seen_ids]
    out[seen_at, seen_ids] = torch.where(seen > 0, seen / seen_r, seen * seen_r)
    out[count_at, count_ids] -= frequency * counts + presence * (counts > 0)
    return out


def _host_arrays(seqs: list[Sequence], rows: list[int]) -> list[np.ndarray]:
    """For the adjusted rows of seqs (by batch row): the rows with allowed_token_ids and their (row,
    token id) pairs; the logit biases' pairs and values; the pairs bad_words and min_tokens ban now;
    the tokens seen in the prompt or output of rows with a repetition penalty, and that penalty per
    pair; the distinct output tokens of rows with a frequency or presence penalty, their counts and the
    two penalties per pair. Each pair once per adjustment (a banned pair may repeat: it is set, not
    added)."""
    allowed_rows, allowed_at, allowed_ids = [], [], []
    bias_at, bias_ids, bias = [], [], []
    banned_at, banned_ids = [], []
    seen_at, seen_ids, seen_r = [], [], []
    count_at, count_ids, counts, frequency, presence = [], [], [], [], []
    for i in rows:
        seq = seqs[i]
        params = seq.params
        if params.allowed_token_ids is not None:
            allowed_rows.append(np.full(1, i))
            allowed_at.append(np.full(len(params.allowed_token_ids), i))
            allowed_ids.append(np.asarray(params.allowed_token_ids, dtype=np.int64))
        if params.logit_bias:
            bias_at.append(np.full(len(params.logit_bias), i))
            bias_ids.append(np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias)))
            bias.append(np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
        banned = _bad_words_banned(seq)
        if banned:
            banned_at.append(np.full(len(banned), i))
            banned_ids.append(np.asarray(banned, dtype=np.int64))
        if seq.num_output_tokens < params.min_tokens:
            banned_at.append(np.full(len(seq.min_tokens_stop_ids), i))
            banned_ids.append(np.asarray(seq.min_tokens_stop_ids, dtype=np.int64))
        rep = params.repetition_penalty != 1.0
        if not (rep or params.frequency_penalty or params.presence_penalty):
            continue
        if seq.penalty_history is None:
            seq.penalty_history = PenaltyHistory(seq)
        history = seq.penalty_history
        history.update(seq)
        if rep:
            ids = np.concatenate([history.prompt, np.asarray(history.new_seen, dtype=np.int64)])
            seen_at.append(np.full(len(ids), i))
            seen_ids.append(ids)
            seen_r.append(np.full(len(ids), params.repetition_penalty, dtype=np.float32))
        if params.frequency_penalty or params.presence_penalty:
            n = len(history.counts)
            count_at.append(np.full(n, i))
            count_ids.append(np.fromiter(history.counts.keys(), np.int64, n))
            counts.append(np.fromiter(history.counts.values(), np.float32, n))
            frequency.append(np.full(n, params.frequency_penalty, dtype=np.float32))
            presence.append(np.full(n, params.presence_penalty, dtype=np.float32))
    ints, floats = np.int64, np.float32
    return [
        _joined(allowed_rows, ints), _joined(allowed_at, ints), _joined(allowed_ids, ints),
        _joined(bias_at, ints), _joined(bias_ids, ints), _joined(bias, floats),
        _joined(banned_at, ints), _joined(banned_ids, ints),
        _joined(seen_at, ints), _joined(seen_ids, ints), _joined(seen_r, floats),
        _joined(count_at, ints), _joined(count_ids, ints), _joined(counts, floats),
        _joined(frequency, floats), _joined(presence, floats),
    ]  # fmt: skip


def bad_words_token_ids(tokenizer, words: list[str], vocab: int) -> list[list[int]]:
    """Each word's token ids as vLLM derives them: the word (leading whitespace stripped) encoded
    without special tokens, and encoded after a space too when that gives as many tokens and another
    first token (a word in the middle of a text). ValueError for a word that encodes to no token or
    to ids outside [0, vocab)."""
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"add_request: bad_words: {word!r} encodes to no token")
        sequences.append(list(plain))
        if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(list(spaced))
    outside = [t for ids in sequences for t in ids if not 0 <= t < vocab]
    if outside:
        raise ValueError(f"add_request: bad_words token id {outside[0]} is not in [0, {vocab})")
    return sequences


def _bad_words_banned(seq: Sequence) -> list[int]:
    """The tokens seq's bad words ban at its next position: each word's last token, when the word's
    other tokens end the output so far (a one-token word's, always)."""
    if not seq.bad_words_token_ids:
        return []
    tokens, outputs = seq.token_ids, seq.num_output_tokens
    banned = []
    for ids in seq.bad_words_token_ids:
        prefix = len(ids) - 1
        if prefix == 0 or (outputs >= prefix and tokens[len(tokens) - prefix :] == ids[:-1]):
            banned.append(ids[-1])
    return banned


def _joined(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
