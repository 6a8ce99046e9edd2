"""`kiln quantize --kv-cache fp8`: an FP8 kv_cache_scheme with static k/v scales, as llm-compressor's
recipes write it (compressed-tensors QuantizationArgs: 8-bit float, static, symmetric), which vLLM, and
Kiln with `--kv-cache-dtype fp8 --kv-cache-scales checkpoint`, use for their fp8 cache. Two strategies
(`--kv-cache-strategy`):
    tensor      (default) each attention module's `k_scale` / `v_scale` of shape [1]
    attn_head   compressed-tensors' per-head strategy: `k_scale` / `v_scale` of shape
                [num_kv_heads, 1, 1] (initialize_qparams' shape for it), one scale per kv head

The scales come from the calibration text run through the float32 transformers model being quantized
(after AWQ's folds, which move v_proj's rows: its values are the checkpoint's), before its weights are
quantized: per layer, the keys (after RoPE) and values its cache holds, their min/max over every
token and channel (and, for "tensor", every head) turned into a scale by the library's own
calculate_qparams (max |x| / 448: stored = value / scale). A value past the calibration's peak
saturates at +-448 * scale in the cache.
"""

from __future__ import annotations

import torch

KV_CACHE_SCHEMES = ("fp8",)
# compressed-tensors' QuantizationStrategy values; per strategy, the dims of an observation
# [T, num_kv_heads, head_dim] its min/max reduce over
KV_CACHE_STRATEGIES = {"tensor": (0, 1, 2), "attn_head": (0, 2)}


def kv_cache_observations(
    hf: torch.nn.Module, source: str, text: str | None, max_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per decoder layer (keys, values) float32 [T, num_kv_heads, head_dim]: what the transformers model
    `hf` caches while prefilling the first `max_tokens` tokens of `text` (None: the text `kiln verify
    --quant-model` calibrates on) in `source`'s tokenizer."""
    import transformers

    from kiln.models.calibration import read_text

    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    ids = tokenizer(read_text("calibration.txt") if text is None else text)["input_ids"][:max_tokens]
    if len(ids) < 2:
        raise ValueError("kiln quantize: --kv-cache: the calibration text gives fewer than 2 tokens")
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    # each layer's [1, num_kv_heads, T, head_dim]
    return [
        (layer.keys[0].transpose(0, 1).float(), layer.values[0].transpose(0, 1).float())
        for layer in cache.layers
    ]


def attach_kv_cache_scales(
    hf: torch.nn.Module,
    observations: list[tuple[torch.Tensor, ...]],
    dtype: torch.dtype,
    strategy: str = "tensor",
):
    """Give each attention module of the transformers model `hf` compressed-tensors' `k_scale` and
    `v_scale` (in `dtype`, the checkpoint's; [1] for strategy "tensor", [num_kv_heads, 1, 1] for
    "attn_head") from `observations` (kv_cache_observations); returns the kv_cache_scheme's
    QuantizationArgs for the checkpoint's quantization_config."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if strategy not in KV_CACHE_STRATEGIES:
        raise ValueError(
            f"kiln quantize: --kv-cache-strategy {strategy!r} unsupported, expected one of "
            + ", ".join(KV_CACHE_STRATEGIES)
        )
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)
    layers = hf.model.layers
    if len(layers) != len(observations):
        raise ValueError(
            f"kiln quantize: --kv-cache: {len(observations)} calibrated layers for a model of {len(layers)}"
        )
    reduce = KV_CACHE_STRATEGIES[strategy]
    with torch.no_grad():
        for layer, (keys, values) in zip(layers, observations, strict=True):
            attn = layer.self_attn
            for kind, observed in (("k", keys), ("v", values)):
                heads, dim = observed.shape[1], observed.shape[2]
                initialize_qparams(attn, kind, args, (heads, None, dim), dtype, force_zero_point=False)
                param = getattr(attn, f"{kind}_scale")
                lo, hi = observed.amin(reduce), observed.amax(reduce)
                scale, _ = calculate_qparams(lo.reshape(param.shape), hi.reshape(param.shape), args)
                param.data = scale.to(param.dtype).reshape(param.shape)
    return args
