"""What a quantized checkpoint's config selects, per module: compressed-tensors' precedence among config
groups (checked against the library's own decompression), block-FP8 block sizes, GPTQ's g_idx and
formats Kiln does not take, and quantized MoE experts. Each case failed or loaded wrong weights
silently before (a review of the loaders)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.loaders.safetensors import load_safetensors_dir
from kiln.models import ModelLoadError, get_model_class
from tests.loaders.ct_checkpoints import CONFIG, save_calibrated
from tests.models.helpers import prompt_logits

transformers = pytest.importorskip("transformers")


def _write_two_group_llama(directory: str, linear_first: bool) -> dict:
    """A tiny Llama quantized by compressed-tensors with two groups: "Linear" W4A16 (symmetric) and
    "re:.*down_proj" W4A16_ASYM; returns the asymmetric scheme."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    generator = torch.Generator().manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # down_proj off-centre, so its zero points are far from the symmetric 8
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise + 0.2 * ("down_proj" in name))
    linear = preset_name_to_scheme("W4A16", ["Linear"])
    asym = preset_name_to_scheme("W4A16_ASYM", ["re:.*down_proj"])
    groups = {"group_0": linear, "group_1": asym} if linear_first else {"group_0": asym, "group_1": linear}
    apply_quantization_config(hf, QuantizationConfig(config_groups=groups, ignore=["lm_head"]))
    save_calibrated(hf, directory, {})
    return asym


@pytest.mark.parametrize("linear_first", [True, False], ids=["linear_group_first", "regex_group_first"])
def test_a_regex_group_outranks_linear_as_compressed_tensors_ranks_them(linear_first, tmp_path):
    """Kiln took the first group matching by name, regex or "Linear": down_proj got the symmetric
    scheme, its stored zero points unread (max error 0.55 of weights up to 1.5)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    asym = _write_two_group_llama(str(tmp_path), linear_first)
    state = load_file(f"{tmp_path}/model.safetensors")
    _, weights = load_safetensors_dir(str(tmp_path))
    for module, scheme in (("model.layers.0.mlp.down_proj", asym), ("model.layers.0.mlp.up_proj", None)):
        local = {k[len(module) + 1 :]: v for k, v in state.items() if k.startswith(module + ".")}
        if scheme is None:  # the Linear group's: read it from the config as written
            with open(f"{tmp_path}/config.json") as f:
                groups = json.load(f)["quantization_config"]["config_groups"].values()
            scheme = QuantizationScheme(**next(g for g in groups if g["targets"] == ["Linear"]))
        ref = PackedQuantizationCompressor.decompress(local, QuantizationScheme(**scheme.model_dump()))
        ref = ref["weight"].float()
        got = weights.get(module + ".weight", tuple(ref.shape)).dequantize(torch.float32)
        assert torch.equal(got, ref), module


def _write_fp8_block_checkpoint(directory: str, block: int, moe: bool) -> dict:
    """A tiny Llama whose projection weights are block FP8 with `weight_scale_inv`, as DeepSeek /
    Qwen3-FP8 checkpoints store them (moe: a Qwen3-MoE whose experts only are); returns the dense
    weights the FP8 values and scales stand for, computed here."""
    if moe:
        cfg = transformers.Qwen3MoeConfig(
            vocab_size=128, hidden_size=256, intermediate_size=256, moe_intermediate_size=128,
            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
            num_experts_per_tok=2, max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[],
        )  # fmt: skip
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    hf.save_pretrained(directory)
    state = load_file(f"{directory}/model.safetensors")
    generator = torch.Generator().manual_seed(3)
    out, dense = {}, {}
    for name, w in state.items():
        if not (name.endswith("_proj.weight") and w.dim() == 2) or (moe and ".experts." not in name):
            out[name] = w
            continue
        n, k = w.shape
        scale = 0.01 + 0.02 * torch.rand(-(-n // block), -(-k // block), generator=generator)
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q, scale
        dense[name] = q.float() * full
    save_file(out, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]
    }  # fmt: skip
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)
    return dense


def test_block_fp8_moe_experts_load_as_the_dense_weights_they_stand_for(tmp_path):
    """Quantized experts (Qwen3-30B-A3B-FP8's layout) failed with AttributeError: 'BlockFP8Weight'
    object has no attribute 'to'."""
    dense = _write_fp8_block_checkpoint(str(tmp_path / "fp8"), 128, moe=True)
    config, weights = load_safetensors_dir(str(tmp_path / "fp8"))
    model = get_model_class(config.architecture)(config, weights)
    # the same model with the dense weights written as plain float32
    state = load_file(f"{tmp_path}/fp8/model.safetensors")
    plain = {k: v for k, v in state.items() if not k.endswith("weight_scale_inv")}
    plain.update(dense)
    (tmp_path / "dense").mkdir()
    save_file(plain, f"{tmp_path}/dense/model.safetensors", metadata={"format": "pt"})
    with open(f"{tmp_path}/fp8/config.json") as f:
        dense_config = json.load(f)
    del dense_config["quantization_config"]
    with open(f"{tmp_path}/dense/config.json", "w") as f:
        json.dump(dense_config, f)
    config, weights = load_safetensors_dir(str(tmp_path / "dense"))
    reference = get_model_class(config.architecture)(config, weights)
    prompt = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 17, 90]
    ours, ref = prompt_logits(model, prompt).double(), prompt_logits(reference, prompt).double()
    # the experts are dequantized at load (the fused MoE takes dense experts): float32 both
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_block_fp8_blocks_other_than_128_fail_at_load_by_name(tmp_path):
    """A 64x64 checkpoint loaded, then failed at the first forward with a bare ValueError."""
    _write_fp8_block_checkpoint(str(tmp_path), 64, moe=False)
    named = r"tensor .model\.layers\.0\.\w+\.\w+_proj\.weight.*64x64.*128x128"
    with pytest.raises(ModelLoadError, match=named):
        load_safetensors_dir(str(tmp_path))


def _gptq_checkpoint(directory: str, desc_act: bool, **extra) -> tuple[torch.Tensor, list[int]]:
    """A tiny Llama whose q_proj is GPTQ (v1 zeros, act-order g_idx, group 32), the rest dense; returns
    q_proj's dense weight as the integers, zeros, scales and g_idx stand for (computed here), and the
    prompt. desc_act: what the config says (the g_idx is act-order either way)."""
    from kiln.quant.gptq import pack_gptq_qweight
    from kiln.quant.int4 import pack_int4

    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    hf.save_pretrained(directory)
    state = load_file(f"{directory}/model.safetensors")
    name = "model.layers.0.self_attn.q_proj"
    n, k = state[name + ".weight"].shape
    generator = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (n, k), generator=generator)
    groups = k // 32
    zeros = torch.randint(1, 15, (n, groups), generator=generator)
    scales = (0.01 + 0.02 * torch.rand(n, groups, generator=generator)).half().float()  # stored fp16
    g_idx = torch.randperm(k, generator=generator) % groups  # act-order: any input in any group
    dense = (q - zeros[:, g_idx]).float() * scales[:, g_idx]
    del state[name + ".weight"]
    state[name + ".qweight"] = pack_gptq_qweight(q)
    state[name + ".qzeros"] = pack_int4((zeros - 1).T.contiguous())  # v1: z - 1 stored
    state[name + ".scales"] = scales.T.contiguous().half()
    state[name + ".g_idx"] = g_idx.to(torch.int32)
    save_file(state, f"{directory}/model.safetensors", metadata={"format": "pt"})
    with open(f"{directory}/config.json") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": False, **extra
    }  # fmt: skip
    with open(f"{directory}/config.json", "w") as f:
        json.dump(config, f)
    return dense, name


def test_gptq_reads_g_idx_whatever_desc_act_says(tmp_path):
    """An act-order g_idx with desc_act false in the config was ignored: relative logit error 1.4."""
    dense, name = _gptq_checkpoint(str(tmp_path), desc_act=False)
    _, weights = load_safetensors_dir(str(tmp_path))
    got = weights.get(name + ".weight", tuple(dense.shape)).dequantize(torch.float32)
    assert torch.allclose(got, dense, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"is_marlin_format": True}, "checkpoint_format 'marlin'"),
        ({"dynamic": {"+:.*q_proj": {"bits": 8}}}, "'dynamic' override"),
    ],
)
def test_gptq_formats_and_overrides_kiln_lacks_fail_at_load_by_name(extra, named, tmp_path):
    _gptq_checkpoint(str(tmp_path), desc_act=True, **extra)
    with pytest.raises(ModelLoadError, match=rf"q_proj\.weight.*{named}"):
        load_safetensors_dir(str(tmp_path))
