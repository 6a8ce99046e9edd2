"""Tiny random HF checkpoints (written by transformers' save_pretrained, with a word-level
tokenizer.json) for the tensor-parallel tests, and a recorder of the logits an engine samples from."""

from __future__ import annotations

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers


def write_checkpoint(directory, family: str, seed: int = 0, **overrides) -> str:
    """family "llama" | "qwen2"; weights large enough that next-token logits are far from ties."""
    common = dict(hidden_size=64, num_hidden_layers=2, max_position_embeddings=256)
    if family == "llama":
        config = transformers.LlamaConfig(
            **{**common, "vocab_size": 130, "intermediate_size": 96, "num_attention_heads": 4,
               "num_key_value_heads": 1, **overrides}
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(
            **{**common, "vocab_size": 144, "intermediate_size": 80, "num_attention_heads": 4,
               "num_key_value_heads": 2, "tie_word_embeddings": True, **overrides}
        )  # fmt: skip
        model = transformers.Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    model.eval().save_pretrained(str(directory))
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return str(directory)


def record_logits(engine) -> list[torch.Tensor]:
    """Every compute_logits result of the engine's (rank-0) model, appended per step."""
    model = engine.runner.model
    compute = model.compute_logits
    seen: list[torch.Tensor] = []

    def recording(hidden):
        logits = compute(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = recording
    return seen


def run_to_completion(engine, prompts, params) -> dict[str, list[int]]:
    """Token ids of every request, run together (continuous batching)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
    return tokens


def run_tensor_parallel(config, prompts, params, inspect=None, tp_size: int = 2):
    """(token ids of every request, the logits rank 0 sampled from) of a TensorParallelEngine run over
    `config`; `inspect(engine)` runs on the live engine first. Every worker must exit with status 0."""
    from kiln.distributed import TensorParallelEngine

    with TensorParallelEngine(config, tp_size=tp_size, timeout_s=30) as engine:
        workers = list(engine.workers)
        if inspect is not None:
            inspect(engine)
        logits = record_logits(engine)
        tokens = run_to_completion(engine, prompts, params)
    assert all(process.exitcode == 0 for process in workers)
    return tokens, logits
