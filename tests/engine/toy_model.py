"""A tiny deterministic model with the kiln.models interface and a real paged KV cache, so engine
logic (batching, prefix caching, preemption, chunked prefill) is tested fast and without weights.

Its attention reads keys and values back from the paged cache through block_tables and slot
math, so a wrong slot mapping, block table or reused block changes the tokens it produces."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kiln.loaders import LoadedModel

VOCAB = 64
EOS = 1


class ToyTokenizer:
    """Token i <-> one character; token EOS is special (skipped in decode)."""

    eos_token_ids = [EOS]
    bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [2 + (ord(c) - 32) % (VOCAB - 2) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + (i - 2) % (VOCAB - 2)) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<a>" if add_generation_prompt else ""
        )

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt)
        return self.encode(text, add_special_tokens=False)


class ToyModel(torch.nn.Module):
    def __init__(self, hidden: int = 32, heads: int = 2, seed: int = 0, max_pos: int = 4096):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.config = SimpleNamespace(
            num_layers=1,
            num_kv_heads=heads,
            head_dim=hidden // heads,
            vocab_size=VOCAB,
            max_position_embeddings=max_pos,
            sliding_window=None,
            eos_token_ids=[EOS],
        )
        self.kv_cache_dtype = torch.float32
        self.embed = torch.randn(VOCAB, hidden, generator=g)
        self.pos = torch.randn(max_pos, hidden, generator=g) * 0.5
        self.wq, self.wk, self.wv, self.wo = (
            torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(4)
        )
        self.head = torch.randn(VOCAB, hidden, generator=g) * 3
        self.heads = heads
        self.forward_calls = 0
        self.tokens_seen = 0

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        self.forward_calls += 1
        self.tokens_seen += input_ids.shape[0]
        md = attn_metadata
        x = self.embed[input_ids] + self.pos[positions]
        t, d = x.shape[0], self.config.head_dim
        q, k, v = ((x @ w).view(t, self.heads, d) for w in (self.wq, self.wk, self.wv))
        key_cache, value_cache = kv_caches[0]
        block_size = key_cache.shape[1]
        ok = md.slot_mapping >= 0
        key_cache.view(-1, self.heads, d)[md.slot_mapping[ok]] = k[ok]
        value_cache.view(-1, self.heads, d)[md.slot_mapping[ok]] = v[ok]
        out = torch.empty_like(q)
        cu = md.cu_seqlens_q.tolist()
        for i, seq_len in enumerate(md.seq_lens.tolist()):
            pos = torch.arange(seq_len)
            slots = md.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
            keys = key_cache.view(-1, self.heads, d)[slots]  # [S, heads, d]
            values = value_cache.view(-1, self.heads, d)[slots]
            qi = q[cu[i] : cu[i + 1]]  # the last q_len positions of the sequence
            q_len = qi.shape[0]
            scores = torch.einsum("qhd,khd->hqk", qi, keys) / d**0.5
            q_pos = torch.arange(seq_len - q_len, seq_len)
            scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            out[cu[i] : cu[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
        return x + out.reshape(t, -1) @ self.wo

    def compute_logits(self, hidden):
        return (hidden @ self.head.T).float()

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [len(token_ids), vocab] of the whole sequence at once, with no KV cache (a check on
        the paged path)."""
        ids = torch.tensor(token_ids)
        x = self.embed[ids] + self.pos[torch.arange(len(token_ids))]
        t, d = x.shape[0], self.config.head_dim
        q, k, v = ((x @ w).view(t, self.heads, d) for w in (self.wq, self.wk, self.wv))
        scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        out = torch.einsum("hqk,khd->qhd", scores.masked_fill(causal, float("-inf")).softmax(-1), v)
        return self.compute_logits(x + out.reshape(t, -1) @ self.wo)


def toy_loaded(seed: int = 0, max_pos: int = 4096):
    model = ToyModel(seed=seed, max_pos=max_pos)
    return LoadedModel(model=model, tokenizer=ToyTokenizer(), config=model.config)
