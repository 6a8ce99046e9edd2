"""Rope scalings and a transformers LlamaConfig for them, shared by the rope family's tests."""

import warnings

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3_SCALING}


def hf_llama_config(head_dim, scaling, base):
    """A transformers LlamaConfig with this head_dim, rope scaling (None: default) and rope base."""
    from transformers import LlamaConfig

    rope_parameters = {"rope_theta": base, **(scaling or {"rope_type": "default"})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlamaConfig(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            rope_parameters=rope_parameters,
            max_position_embeddings=131072,
        )
