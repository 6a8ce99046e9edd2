"""Tiny random Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints written by transformers' save_pretrained
(with a word-level tokenizer.json) for the MoE tensor- and expert-parallel tests."""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

COMMON = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256,
)  # fmt: skip


def _hf_model(family: str, overrides: dict):
    if family == "mixtral":
        # intermediate 96 = three 32-column units: TP 2 splits every expert unevenly (64 + 32)
        args = dict(COMMON, vocab_size=130, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**args, **overrides}))
    moe = dict(
        intermediate_size=80,
        moe_intermediate_size=40,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )  # fmt: skip  (layer 0 routed experts, layer 1 a dense MLP)
    if family == "qwen2_moe":
        args = dict(COMMON, vocab_size=144, shared_expert_intermediate_size=56, **moe)
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**args, **overrides}))
    if family == "qwen3_moe":
        args = dict(COMMON, vocab_size=144, head_dim=16, norm_topk_prob=True, **moe)
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**args, **overrides}))
    raise ValueError(f"unknown MoE family {family!r}")


def write_moe_checkpoint(directory, family: str, seed: int = 0, **overrides) -> str:
    """family "mixtral" | "qwen2_moe" | "qwen3_moe": 2 layers, 4 experts, top 2; weights large enough
    that router choices and next-token logits are far from ties (HF leaves the routers at zero)."""
    model = _hf_model(family, overrides)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.eval().save_pretrained(str(directory))
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)
