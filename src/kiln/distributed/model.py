"""Build this rank's shard of a Llama-family model: the unchanged LlamaForCausalLM over a
ShardedWeightStore and a per-rank config, then its communicating layers swapped in:

    embed_tokens -> VocabParallelEmbedding   (all-reduce of the owned rows)
    o_proj, down_proj -> RowParallelLinear   (all-reduce of the partial sums)
    lm_head -> ParallelLMHead                (logits gathered to rank 0)

q/k/v and gate/up stay plain Linears over the rank's rows (column-parallel, no communication).
model.config keeps the rank's head counts (the KV cache is per rank) but the full vocab_size.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from kiln.distributed.groups import TPGroup
from kiln.distributed.sharding import ShardedWeightStore, ShardPlan
from kiln.models.config import ModelConfig, ModelLoadError
from kiln.models.layers.parallel_linear import RowParallelLinear
from kiln.models.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from kiln.models.llama import LlamaForCausalLM
from kiln.models.weights import WeightStore


@dataclasses.dataclass
class Checkpoint:
    """An opened checkpoint (weights read lazily) and how its CPU weights are kept by default."""

    path: str
    config: ModelConfig
    weights: WeightStore
    rope_inv_freq: torch.Tensor | None
    gguf_meta: dict | None
    cpu_format: str | None
    lm_head_format: str | None


def open_checkpoint(path: str | None) -> Checkpoint:
    """The config and lazy weights of a GGUF file or HF directory (None = the embedded model), with the
    same defaults kiln.loaders.load_model uses."""
    from kiln.loaders import DEFAULT_CPU_FORMAT, DEFAULT_LM_HEAD_FORMAT, default_model_path
    from kiln.loaders.gguf import load_gguf
    from kiln.loaders.safetensors import load_safetensors_dir

    path = path or default_model_path()
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: no such file or directory")
    if os.path.isdir(path):
        config, weights = load_safetensors_dir(path)
        return Checkpoint(path, config, weights, None, None, None, None)
    config, weights, meta, rope_inv_freq = load_gguf(path)
    return Checkpoint(path, config, weights, rope_inv_freq, meta, DEFAULT_CPU_FORMAT, DEFAULT_LM_HEAD_FORMAT)


def load_tokenizer(checkpoint: Checkpoint):
    """The checkpoint's tokenizer; also completes config.eos_token_ids / bos_token_id from it (as
    load_model does)."""
    from kiln.loaders.tokenizer import Tokenizer

    config = checkpoint.config
    if checkpoint.gguf_meta is None:
        tokenizer = Tokenizer.from_hf_dir(checkpoint.path, eos_token_ids=config.eos_token_ids)
    else:
        tokenizer = Tokenizer.from_gguf_metadata(checkpoint.gguf_meta, source=checkpoint.path)
    for token_id in tokenizer.eos_token_ids:
        if token_id not in config.eos_token_ids:
            config.eos_token_ids.append(token_id)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return tokenizer


def build_shard(
    checkpoint: Checkpoint,
    plan: ShardPlan,
    group: TPGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> LlamaForCausalLM:
    """Rank group.rank's LlamaForCausalLM, holding only its slices, with the parallel layers in."""
    rank = group.rank
    local_config = plan.rank_config(rank)
    store = ShardedWeightStore(checkpoint.weights, plan, rank)
    kwargs = {"rope_inv_freq": checkpoint.rope_inv_freq} if checkpoint.rope_inv_freq is not None else {}
    with torch.inference_mode(False), torch.no_grad():
        model = LlamaForCausalLM(
            local_config,
            store,
            device=device,
            dtype=dtype,
            cpu_format=checkpoint.cpu_format,
            lm_head_format=checkpoint.lm_head_format,
            **kwargs,
        )
    shard = plan.shards[rank]
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, shard.vocab[0], group)
    model.lm_head = ParallelLMHead(model.lm_head, plan.vocab_sizes, group)
    for layer in model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    model.config = dataclasses.replace(local_config, vocab_size=plan.config.vocab_size)
    return model.eval()
