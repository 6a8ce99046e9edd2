"""kiln.jax.generate: batched generation with a kiln.jax.models.Llama.

One batched prefill of every prompt, then max_tokens - 1 decode steps of the whole batch, tokens
kept on the device between steps (no host round trip per token). To keep jit from recompiling for
every request shape, the batch is padded to a power of two, the prompt length to a power of two
(at least one page), and the pages per sequence to a power of two; the same buckets reuse the
compiled steps. Padding rows of the batch read and write only the scratch page 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kiln.jax.models.llama import Llama


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


def _check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists")
    checked = []
    for i, prompt in enumerate(prompts):
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"generate: prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"generate: prompt {i} has a token id outside [0, {vocab_size})")
        checked.append(ids)
    return checked


def generate(
    model: Llama,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    temperature: float = 0.0,
    *,
    key: jax.Array | None = None,
    stop_at_eos: bool = False,
) -> list[list[int]]:
    """Generate `max_tokens` tokens after each prompt (a list of token ids), all prompts as one batch.

    temperature 0: greedy (argmax); > 0: sampled from softmax(logits / temperature) with `key`
    (a jax.random key; default jax.random.key(0)). stop_at_eos: cut each output after its first
    end-of-sequence token (model.eos_token_ids); otherwise exactly max_tokens tokens each.
    Returns one list of generated token ids per prompt. ValueError for empty prompts, token ids
    outside the vocabulary, max_tokens < 1, or prompt + max_tokens past the model's max position.
    """
    c = model.config
    prompts = _check_prompts(prompts, c.vocab_size)
    if max_tokens < 1:
        raise ValueError(f"generate: max_tokens must be >= 1, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature}")
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > c.max_position:
        raise ValueError(
            f"generate: prompt of {longest} tokens + {max_tokens} new ones exceeds the model's "
            f"{c.max_position} positions"
        )
    batch, seq = bucket(len(prompts)), bucket(longest, c.block_size)
    pages = bucket(-(-(seq + max_tokens) // c.block_size))
    tokens = np.zeros((batch, seq), np.int32)
    lens = np.ones((batch,), np.int32)
    tables = np.zeros((batch, pages), np.int32)  # padding rows: the scratch page 0
    for b, prompt in enumerate(prompts):
        tokens[b, : len(prompt)] = prompt
        lens[b] = len(prompt)
        tables[b] = 1 + b * pages + np.arange(pages)
    keys = jax.random.split(jax.random.key(0) if key is None else key, max_tokens)
    temp = jnp.float32(temperature)
    caches = model.new_cache(1 + batch * pages)
    tables = jnp.asarray(tables)
    positions = jnp.asarray(lens)
    next_tokens, caches = model.prefill(caches, jnp.asarray(tokens), positions, tables, keys[0], temp)
    out = [next_tokens]
    for step in range(1, max_tokens):
        next_tokens, caches = model.decode(caches, next_tokens, positions, tables, keys[step], temp)
        positions = positions + 1
        out.append(next_tokens)
    generated = np.asarray(jnp.stack(out, axis=1))[: len(prompts)].tolist()
    if stop_at_eos and model.eos_token_ids:
        eos = set(model.eos_token_ids)
        generated = [
            ids[: next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))] for ids in generated
        ]
    return generated
