"""Tiny quantized Llama checkpoints written by compressed-tensors (the library llm-compressor uses):
a random transformers Llama, a preset scheme applied with `apply_quantization_config`, scales from
the library's own `calculate_qparams` on min/max (what llm-compressor's min-max observer feeds it;
static activation scales from one calibration forward), compressed by `ModelCompressor` and saved."""

from __future__ import annotations

import torch

CONFIG = dict(
    vocab_size=128, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)  # fmt: skip


def write_quantized_llama(preset: str, directory: str, seed: int = 0) -> None:
    """Save a tiny random Llama quantized with compressed-tensors' `preset` scheme ("FP8_DYNAMIC",
    "FP8", "W8A8", "W4A16", "W4A16_ASYM", "FP8_BLOCK") to `directory` (lm_head left dense)."""
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
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
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
        hf(torch.randint(0, CONFIG["vocab_size"], (1, 16), generator=generator))
    for hook in hooks:
        hook.remove()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    save_calibrated(hf, directory, amax)


def save_calibrated(hf, directory: str, amax: dict[str, float]) -> None:
    """Set the quantization parameters of every module of `hf` (compressed-tensors' schemes applied) from
    its weights (and static activation scales from `amax`, module name -> largest |input|), compress
    with the library's ModelCompressor and save to `directory`."""
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
