"""The static shape of a JAX Llama: what jit specializes on (hashable, so it can be a static argument).

Built from a Kiln checkpoint's config (kiln.models.config.ModelConfig, read by attribute: kiln.jax
sits over kiln.ops only and does not import kiln.models). `tp` is the tensor-parallel degree the
weights were laid out for; head counts here are the padded ones (see kiln.jax.models.weights: heads
are zero-padded up to a multiple of tp, which adds exact zeros to the attention output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class JaxLlamaConfig:
    """Shapes and options of the model as the jitted steps see them.

    num_heads / num_kv_heads: heads after padding to a multiple of tp (real_num_heads /
    real_num_kv_heads: the checkpoint's). head_dim D, rotary_dim (<= D) rotated with NeoX pairs.
    block_size: tokens per KV-cache page. implementation: kiln.jax backend (None, "xla",
    "pallas_tpu", "pallas_gpu"). sliding_window: one window for every layer (None = full).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rms_norm_eps: float
    max_position: int
    real_num_heads: int
    real_num_kv_heads: int
    attention_bias: bool = False
    sliding_window: int | None = None
    block_size: int = 16
    tp: int = 1
    implementation: str | None = None

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of tp: the embedding and LM head rows are split over the
        devices (vocabulary parallel), the extra rows zero and their logits masked out."""
        return -(-self.vocab_size // self.tp) * self.tp

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def config_from_checkpoint(
    model_config: Any, *, tp: int, block_size: int, implementation: str | None
) -> JaxLlamaConfig:
    """A JaxLlamaConfig from a kiln ModelConfig. ValueError for what this model does not run:
    a non-Llama architecture, mixed sliding/full layers, an MLP width or head count that tp cannot
    split."""
    c = model_config
    if c.architecture not in LLAMA_ARCHITECTURES:
        raise ValueError(
            f"kiln.jax.models.Llama: architecture {c.architecture!r} is not a Llama-family model "
            f"(expected one of {', '.join(LLAMA_ARCHITECTURES)})"
        )
    if c.layer_types is not None and len(set(c.layer_types)) > 1:
        raise ValueError("kiln.jax.models.Llama: layers mixing sliding and full attention are not supported")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"kiln.jax.models.Llama: hidden_act {c.hidden_act!r} is not supported (silu only)")
    if tp < 1 or c.intermediate_size % tp:
        raise ValueError(
            f"kiln.jax.models.Llama: tensor-parallel degree {tp} must be >= 1 and divide "
            f"intermediate_size {c.intermediate_size}"
        )
    if block_size < 1:
        raise ValueError(f"kiln.jax.models.Llama: block_size must be >= 1, got {block_size}")
    group = c.num_heads // c.num_kv_heads
    kv_heads = -(-c.num_kv_heads // tp) * tp
    return JaxLlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_layers,
        num_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=c.head_dim,
        rotary_dim=c.rotary_dim or c.head_dim,
        rms_norm_eps=float(c.rms_norm_eps),
        max_position=int(c.max_position_embeddings),
        real_num_heads=c.num_heads,
        real_num_kv_heads=c.num_kv_heads,
        attention_bias=bool(c.attention_bias),
        sliding_window=c.layer_sliding_window(0),
        block_size=block_size,
        tp=tp,
        implementation=implementation,
    )
