"""Tiny quantized Llama checkpoints written by compressed-tensors (the library llm-compressor uses):
a random transformers Llama, a preset scheme applied with `apply_quantization_config`, scales from
the library's own `calculate_qparams` on min/max (what llm-compressor's min-max observer feeds it;
static activation scales from one calibration forward), compressed by `ModelCompressor` and saved.

With `kv_cache_strategy` the checkpoint also quantizes the KV cache as llm-compressor's kv_cache_scheme
does (FP8 e4m3, static, symmetric; "tensor": one k and one v scale a layer, "attn_head": one per kv
head): the library's QuantizationArgs go into config.json's quantization_config (through the
library's own ModelCompressor.update_config), and each attention module gets `k_scale` / `v_scale`
parameters made by the library's `initialize_qparams` (its shapes: [1] or [num_kv_heads, 1, 1], the
model's dtype), set by `calculate_qparams` from the min/max of the keys (after RoPE) and values the
calibration forward cached (what llm-compressor's min-max observer sees). `apply_quantization_config`
with a kv_cache_scheme would attach them itself, but compressed-tensors 0.20 finds attention modules
by a `past_key_values` argument, which transformers 5 renamed `cache`: it skips them, so this helper
makes the same calls for it."""

from __future__ import annotations

import torch

CONFIG = dict(
    vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)  # fmt: skip


def write_quantized_llama(
    preset: str,
    directory: str,
    seed: int = 0,
    kv_cache_strategy: str | None = None,
    weight_std: float = 0.3,
    calibration_tokens: int = 16,
    std_overrides: dict[str, float] | None = None,
) -> None:
    """Save a tiny random Llama quantized with compressed-tensors' `preset` scheme ("FP8_DYNAMIC",
    "FP8", "W8A8", "W4A16", "W4A16_ASYM", "FP8_BLOCK") to `directory` (lm_head left dense);
    kv_cache_strategy "tensor" / "attn_head": with an FP8 kv_cache_scheme and its k/v scales. Weights
    weight_std x N(0, 1), or the std of the first std_overrides key their name contains; norms
    1 + 0.1 x N(0, 1). Static scales from one forward of `calibration_tokens` random tokens."""
    import transformers
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    generator = torch.Generator().manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            std = next((s for part, s in (std_overrides or {}).items() if part in name), weight_std)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)
    amax: dict[str, float] = {}

    def record(module_name):
        def hook(module, args):
            amax[module_name] = max(amax.get(module_name, 0.0), args[0].abs().max().item())

        return hook

    hooks = [
        m.register_forward_pre_hook(record(n))
        for n, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    with torch.no_grad():
        ids = torch.randint(0, CONFIG["vocab_size"], (1, calibration_tokens), generator=generator)
        out = hf(ids, use_cache=True)
    for hook in hooks:
        hook.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    kv_cache_scheme = None
    if kv_cache_strategy is not None:
        kv_cache_scheme = add_kv_cache_scales(hf, out.past_key_values, kv_cache_strategy)
    save_calibrated(hf, directory, amax, kv_cache_scheme)


def add_kv_cache_scales(hf, cache, strategy: str):
    """Give every attention module of `hf` compressed-tensors' k_scale / v_scale for an FP8 kv_cache_scheme
    of `strategy`, from the min/max of the keys and values in `cache` (a transformers DynamicCache, each
    layer's [1, num_kv_heads, T, head_dim]); returns the scheme's QuantizationArgs."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)
    heads, dim = CONFIG["num_key_value_heads"], CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    with torch.no_grad():
        for layer, attn in zip(cache.layers, (block.self_attn for block in hf.model.layers), strict=True):
            for kind, observed in (("k", layer.keys[0]), ("v", layer.values[0])):
                initialize_qparams(
                    attn, kind, args, (heads, None, dim), torch.float32, force_zero_point=False
                )
                reduce = (0, 1, 2) if strategy == "tensor" else (1, 2)
                lo, hi = observed.amin(reduce), observed.amax(reduce)
                scale, _ = calculate_qparams(lo, hi, args)
                param = getattr(attn, f"{kind}_scale")
                param.data = scale.to(param.dtype).reshape(param.shape)
    return args


def save_calibrated(hf, directory: str, amax: dict[str, float], kv_cache_scheme=None) -> None:
    """Set the quantization parameters of every module of `hf` (compressed-tensors' schemes applied) from
    its weights (and static activation scales from `amax`, module name -> largest |input|), compress
    with the library's ModelCompressor and save to `directory` (with `kv_cache_scheme`, QuantizationArgs,
    in its quantization_config)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    with torch.no_grad():
        for name, module in hf.named_modules():
            s = getattr(module, "quantization_scheme", None)
            if s is None:
                continue
            w, args = module.weight.float(), s.weights
            if args.strategy == "tensor":
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            elif args.strategy == "group":
                g = w.reshape(w.shape[0], -1, args.group_size)
                lo, hi = g.amin(-1), g.amax(-1)
            else:  # block
                bn, bk = args.block_structure
                g = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
                lo, hi = g.amin((1, 3)), g.amax((1, 3))
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
            if hasattr(module, "weight_zero_point"):
                zp = module.weight_zero_point
                zp.data = zero.to(zp.dtype).reshape(zp.shape)
            acts = s.input_activations
            if acts is not None and not acts.dynamic:
                v = torch.tensor([amax[name]])
                scale, _ = calculate_qparams(-v, v, acts)
                module.input_scale.data = scale.to(module.input_scale.dtype).reshape(module.input_scale.shape)
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.quantization_config.kv_cache_scheme = kv_cache_scheme
    compressor.compress_model(hf)
    hf.save_pretrained(directory)
    compressor.update_config(directory)


def decompressed_llama(directory: str):
    """A float32 transformers Llama whose Linear weights are compressed-tensors' own decompression of
    the checkpoint's packed weights (PackedQuantizationCompressor.decompress): the reference for a
    weight-only scheme transformers cannot load itself (asymmetric pack-quantized in transformers
    5.x: its empty zero-point parameters have the unpacked shape)."""
    import json

    import transformers
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    group = config["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme(**group)
    state = load_file(f"{directory}/model.safetensors")
    dense = {}
    for name in [n for n in state if n.endswith(".weight_packed")]:
        module = name[: -len(".weight_packed")]
        local = {k[len(module) + 1 :]: state.pop(k) for k in list(state) if k.startswith(module + ".")}
        dense[module + ".weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    state.update(dense)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    hf.load_state_dict(state, strict=False)
    return hf.float().eval()


# A residual stream the embeddings dominate (each layer adds a small part, as in a trained model): with
# every weight at 0.1 the 2.6% e4m3 error of layer 0's keys grows to ~10% on a 2-layer random Llama's
# logits (measured), and greedy tokens part from a 16-bit cache's within a few steps whatever the scales
# (at 0.3, the other tests' checkpoints, mostly at the first).
KV_WELL_CONDITIONED = dict(
    weight_std=0.1, std_overrides={"embed": 1.0, "o_proj": 0.03, "down_proj": 0.03}, calibration_tokens=64
)


def write_kv_scaled_llama(directory, strategy: str | None, preset: str = "W4A16") -> str:
    """A loadable checkpoint (word-level tokenizer.json included) of write_quantized_llama's `preset`
    with an FP8 kv_cache_scheme of `strategy` ("tensor", "attn_head"; None: no KV-cache quantization),
    weights as KV_WELL_CONDITIONED says, KV scales from 64 calibration tokens. Returns its path."""
    write_quantized_llama(preset, str(directory), kv_cache_strategy=strategy, **KV_WELL_CONDITIONED)
    write_word_level_tokenizer(directory)
    return str(directory)


def write_word_level_tokenizer(directory) -> None:
    """tokenizer.json of a word-level vocabulary "t0" .. "t127" (CONFIG's), so the engine can load it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(CONFIG["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(f"{directory}/tokenizer.json")


# End-to-end logits of a checkpoint whose activations are quantized per token (fp8, int8) against
# transformers: one float32 ULP upstream can move an activation across a rounding midpoint, a whole grid
# step the later layers amplify (measured 5.3e-3, 1.0e-2, 2.2e-2); worst_projection_error stays at 1e-5
TOL_QUANTIZED_ACTIVATIONS = 5e-2

# Kiln's fused projections -> the transformers Llama projections stacked in them (rows, in order)
_FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def worst_projection_error(model, hf, prompt: list[int]) -> float:
    """Largest relative L2 error, over every layer's projections, of Kiln's `model` Linear against
    transformers' (compressed-tensors fake-quantized) modules of `hf`, both fed the input transformers'
    forward of `prompt` gave that projection. Identical inputs mean identical dynamic activation
    scales and grid points, so this is tight where the end-to-end logits are not: there a one-ULP
    difference upstream can put an activation on the other side of a rounding midpoint."""
    inputs: dict[str, torch.Tensor] = {}

    def keep(name):
        return lambda _, args: inputs.__setitem__(name, args[0].detach())

    hooks = [
        module.register_forward_pre_hook(keep(name))
        for name, module in hf.named_modules()
        if name.endswith("_proj")
    ]
    try:
        with torch.no_grad():
            hf(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    worst = 0.0
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for ours, theirs in _FUSED_PROJECTIONS.items():
                x = inputs[f"model.layers.{i}.{theirs[0]}"]  # [1, tokens, in]: per-token scales
                ref = torch.cat([hf.get_submodule(f"model.layers.{i}.{t}")(x) for t in theirs], -1)
                ref = ref[0].double()
                out = layer.get_submodule(ours)(x[0]).double()
                worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    return worst
