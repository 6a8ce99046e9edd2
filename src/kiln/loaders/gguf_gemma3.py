"""What a Gemma 3 GGUF (llama.cpp's `gemma3` architecture) needs beyond the Llama mapping.

Tensor names: `ffn_norm` is the pre-feedforward norm here (Llama's post-attention norm), and Gemma
adds `post_attention_norm`, `post_ffw_norm`, `attn_q_norm`, `attn_k_norm`. Q/K rows are not permuted
(Gemma's rope is NeoX-style in llama.cpp too).

Norm weights: llama.cpp's converter stores every `*norm.weight` as 1 + w (Gemma3RMSNorm scales by
1 + w); the loader subtracts the 1 again in float32, so the WeightStore holds HF's values and the
model's norm adds it back in its kernel (kiln.models.gemma3).

Metadata llama.cpp writes: the usual `gemma3.*` sizes, `rope.freq_base` (global layers),
`rope.scaling.type/factor` (linear, global layers), `attention.sliding_window`. What it does not
write, llama.cpp assumes, and so do we: every 6th layer global (`attention.sliding_window_pattern`
when present: an int period or a per-layer bool array, true = sliding), local rope base 10000
(`rope.freq_base_swa` when present), and the score scale head_dim ** -0.5 except for the 62-layer
27B model, hidden / heads (`attention.scale` when present). `final_logit_softcapping` is read if
present.
"""

from __future__ import annotations

from typing import Any

from kiln.loaders.config_checks import is_int
from kiln.models.config import ModelConfig, ModelLoadError

GEMMA3_PER_LAYER = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# llama.cpp's converter adds this to every Gemma 3 norm weight.
GEMMA3_NORM_SHIFT = 1.0
_DEFAULT_PATTERN = 6  # llama.cpp: set_swa_pattern(6)
_DEFAULT_LOCAL_ROPE_BASE = 10000.0
_LAYERS_OF_27B = 62


def is_shifted_norm(hf_name: str) -> bool:
    """Whether the converter stored this tensor as 1 + w."""
    return hf_name.endswith("norm.weight")


def complete_gemma3_config(config: ModelConfig, meta: dict[str, Any], source: str) -> None:
    """Fill in (in place) what kiln.models.gemma3 reads: hidden_act, layer_types and, in
    config.extra under HF's key names, query_pre_attn_scalar, rope_local_base_freq and
    final_logit_softcapping."""
    arch = "gemma3"

    def number(key: str) -> float | None:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ModelLoadError(f"{source}: metadata key '{arch}.{key}' is {value!r}, expected a number > 0")
        return float(value)

    config.hidden_act = "gelu_pytorch_tanh"
    config.layer_types = _layer_types(meta.get(f"{arch}.attention.sliding_window_pattern"), config, source)
    scale = number("attention.scale")
    if scale is not None:
        query_pre_attn_scalar = scale**-2
    elif config.num_layers == _LAYERS_OF_27B:
        query_pre_attn_scalar = config.hidden_size / config.num_heads
    else:
        query_pre_attn_scalar = float(config.head_dim)
    config.extra.update(
        query_pre_attn_scalar=query_pre_attn_scalar,
        rope_local_base_freq=number("rope.freq_base_swa") or _DEFAULT_LOCAL_ROPE_BASE,
        final_logit_softcapping=number("final_logit_softcapping"),
    )


def _layer_types(pattern: Any, config: ModelConfig, source: str) -> list[str]:
    if pattern is None:
        pattern = _DEFAULT_PATTERN
    if isinstance(pattern, list):
        if len(pattern) != config.num_layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelLoadError(
                f"{source}: metadata key 'gemma3.attention.sliding_window_pattern' is a list of "
                f"{len(pattern)} entries, expected {config.num_layers} booleans (one per layer)"
            )
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    if not is_int(pattern) or pattern < 1:
        raise ModelLoadError(
            f"{source}: metadata key 'gemma3.attention.sliding_window_pattern' is {pattern!r}, "
            "expected an integer >= 1 or a list of booleans"
        )
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(config.num_layers)
    ]
