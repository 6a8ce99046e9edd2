"""Calibration: run a Kiln model over token ids once, outside the engine, and measure what pruning and
quantization methods need from its activations (Wanda's per-column input norms).

`prefill` builds the attention metadata of one sequence laid out in blocks 0, 1, ... of a fresh KV cache;
`checkpoint_input_norms` maps the norms of each fused Linear's input back to the checkpoint's weight names
(q/k/v share the fused QKV projection's input, gate/up the fused gate/up projection's).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

import kiln.ops
from kiln.models.attention_metadata import AttentionMetadata

TEXTS = os.path.join(os.path.dirname(__file__), "texts")

# checkpoint projection (under model.layers.{i}.) -> the Kiln module that consumes its input
_LLAMA_LINEARS = {
    "self_attn.q_proj": "self_attn.qkv_proj",
    "self_attn.k_proj": "self_attn.qkv_proj",
    "self_attn.v_proj": "self_attn.qkv_proj",
    "self_attn.o_proj": "self_attn.o_proj",
    "mlp.gate_proj": "mlp.gate_up_proj",
    "mlp.up_proj": "mlp.gate_up_proj",
    "mlp.down_proj": "mlp.down_proj",
}


def read_text(name: str) -> str:
    """A text shipped with Kiln: "calibration.txt" (mixed prose, Q&A, code: what calibration runs on by
    default) or "perplexity.txt" (prose written for Kiln, never calibrated on: `kiln verify --quant-model`
    measures perplexity on it)."""
    with open(os.path.join(TEXTS, name), encoding="utf-8") as f:
        return f.read()


def prefill(
    model: torch.nn.Module,
    token_ids: list[int],
    block_size: int = 16,
    return_kv_caches: bool = False,
    kv_caches: list[tuple] | None = None,
):
    """One prefill of `token_ids` on the model's device: hidden [T, hidden], or with return_kv_caches
    (hidden, [(key_cache, value_cache)] per layer, each [blocks, block_size, num_kv_heads, head_dim]
    holding position p at slot p). kv_caches: the layers' caches to fill, laid out that way (any
    cache dtype, fp8 with its scales); default fresh zeros in the model's kv_cache_dtype."""
    c, T = model.config, len(token_ids)
    if T == 0:
        raise ValueError("prefill: no tokens")
    device = torch.device(getattr(model, "device", "cpu"))
    num_blocks = -(-T // block_size)
    if kv_caches is None:
        shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
        dtype = getattr(model, "kv_cache_dtype", torch.float32)
        kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(c.num_layers)
        ]
    positions = torch.arange(T, dtype=torch.int64, device=device)
    metadata = AttentionMetadata(
        slot_mapping=positions.clone(),  # blocks in order: slot = position
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([T], dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=device),
        max_seqlen_q=T,
        max_seqlen_k=T,
        decode_only=T == 1,
    )
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    with torch.inference_mode(), kiln.ops.trusted_inputs():  # the metadata is built here, correctly
        hidden = model(ids, positions, kv_caches, metadata)
    return (hidden, kv_caches) if return_kv_caches else hidden


def linear_input_norms(model: torch.nn.Module, prompts: Iterable[list[int]]) -> dict[str, torch.Tensor]:
    """{module name (as in model.named_modules()): float32 [in_features] L2 norm of each input column
    over every token of `prompts`} for every module with `in_features` under model.layers."""
    squares = _reduce_linear_inputs(model, prompts, lambda x: x.square().sum(0), torch.add)
    return {name: total.sqrt() for name, total in squares.items()}


def linear_input_peaks(model: torch.nn.Module, prompts: Iterable[list[int]]) -> dict[str, torch.Tensor]:
    """{module name: float32 [in_features] max |x| of each input column over every token of `prompts`}
    for every module with `in_features` under model.layers (SmoothQuant's activation statistic)."""
    return _reduce_linear_inputs(model, prompts, lambda x: x.abs().amax(0), torch.maximum)


def _reduce_linear_inputs(model, prompts, per_prefill, combine) -> dict[str, torch.Tensor]:
    """Prefill each prompt with a forward pre-hook on every Linear under model.layers; per module,
    per_prefill(x float32 [tokens, in_features]) combined over the prompts (on the CPU)."""
    totals: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs):
            value = per_prefill(inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])).cpu()
            totals[name] = combine(totals[name], value) if name in totals else value

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if name.startswith("layers.") and hasattr(module, "in_features")
    ]
    try:
        for token_ids in prompts:
            prefill(model, token_ids)
    finally:
        for handle in handles:
            handle.remove()
    return totals


def checkpoint_input_norms(model: torch.nn.Module, prompts: Iterable[list[int]]) -> dict[str, torch.Tensor]:
    """{checkpoint weight name, e.g. "model.layers.3.mlp.up_proj.weight": float32 [in_features]} for the
    dense Llama-family projections (Llama, Mistral, Qwen2, SmolLM2). Other layouts (MoE experts, Phi-3's
    fused checkpoint tensors) raise ValueError naming the module."""
    norms = linear_input_norms(model, prompts)
    out: dict[str, torch.Tensor] = {}
    for i in range(len(model.layers)):
        for projection, module in _LLAMA_LINEARS.items():
            key = f"layers.{i}.{module}"
            if key not in norms:
                raise ValueError(
                    f"checkpoint_input_norms: layer {i} has no {module} Linear (architecture "
                    f"{model.config.architecture!r}); only dense Llama-family layers are mapped"
                )
            out[f"model.layers.{i}.{projection}.weight"] = norms[key]
    return out
