"""`kiln generate --logprobs N / --prompt-logprobs N`: the per-token log-probabilities, printed after the
completion (each token, its logprob, its top-N alternatives), and for the prompt its total and
perplexity (how likely the model finds the text: the score lm-eval's loglikelihood requests read)."""

from __future__ import annotations

import math


def _token(tokenizer, token_id: int) -> str:
    return repr(tokenizer.decode([token_id]))


def _alternatives(tokenizer, entry: dict[int, float], chosen: int, top: int) -> str:
    ranked = sorted(((t, lp) for t, lp in entry.items() if t != chosen), key=lambda item: -item[1])[:top]
    return ", ".join(f"{_token(tokenizer, t)} {lp:.3f}" for t, lp in ranked)


def format_token_logprobs(
    tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], top: int, title: str
) -> str:
    """One line per token: its text, its logprob and the `top` best alternatives; then the sum and the
    perplexity over the tokens that have an entry (a prompt's first token has none)."""
    lines = [f"--- {title} logprobs (token, logprob, top {top} alternatives)"]
    total, counted = 0.0, 0
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            lines.append(f"  {_token(tokenizer, token_id):<20} (first token: no context)")
            continue
        logprob = entry[token_id]
        total, counted = total + logprob, counted + 1
        alternatives = _alternatives(tokenizer, entry, token_id, top) if top else ""
        lines.append(f"  {_token(tokenizer, token_id):<20} {logprob:9.4f}   {alternatives}".rstrip())
    if counted:
        perplexity = math.exp(-total / counted)
        summary = f"{counted} tokens scored, sum logprob {total:.4f}, perplexity {perplexity:.3f}"
        lines.append(f"--- {title}: {summary}")
    return "\n".join(lines)
