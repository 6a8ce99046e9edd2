"""Broken checkpoints fail with a ModelLoadError (a ValueError) that names the file and the tensor:
truncated GGUF and safetensors files, garbage files, missing tensors, mismatched shapes, unknown
architectures, pickle-only directories."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("gguf")

from kiln.loaders import load_model  # noqa: E402
from kiln.models import ModelLoadError  # noqa: E402
from tests.loaders.gguf_tiny import write_tiny_gguf  # noqa: E402
from tests.loaders.test_gguf_loader import tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama saved by transformers (single safetensors file) plus a tokenizer.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("hf")
    tiny_llama().save_pretrained(directory)
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _copy(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


def test_hf_dir_fixture_loads(hf_dir):
    assert load_model(str(hf_dir)).config.num_layers == 2


def test_truncated_safetensors_names_the_file(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: truncated"):
        load_model(str(d))


def test_missing_safetensors_tensor_names_it(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_model(str(d))


def test_wrong_shape_names_tensor_and_both_shapes(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(95, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(95, 64\), expected \(96, 64\)",
    ):
        load_model(str(d))


def test_unknown_hf_architecture_is_rejected_by_name(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"config\.json: unknown architecture 'GPTNeoXForCausalLM'"):
        load_model(str(d))


@pytest.mark.parametrize(
    "scaling, message",
    [
        ({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}, "needs key 'low_freq_factor'"),
        ({"rope_type": "linear", "factor": 0}, "factor must be positive"),
        ({"rope_type": "linear"}, "needs key 'factor'"),
    ],
)  # fmt: skip
def test_a_malformed_rope_scaling_fails_at_load_naming_the_file(hf_dir, tmp_path, scaling, message):
    """It raised a plain ValueError from inside the model's rotary embedding, naming no file."""
    d = _copy(hf_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    config["rope_scaling"] = scaling
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"config\.json: .*{message}"):
        load_model(str(d))


def test_pickle_only_directory_is_refused(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are not loaded"):
        load_model(str(d))


def test_truncated_gguf_names_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(), path)
    data = path.read_bytes()
    for cut in (len(data) - 100, 200):  # inside the tensor data; inside the metadata
        broken = tmp_path / f"cut{cut}.gguf"
        broken.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}\\.gguf"):
            load_model(str(broken))


def test_garbage_file_is_not_a_gguf(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"noise\.gguf: not a readable GGUF file"):
        load_model(str(path))


def test_unknown_gguf_architecture_is_rejected_by_name(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(tiny_llama(), path, arch="falcon")
    with pytest.raises(ModelLoadError, match=r"falcon\.gguf: unknown architecture 'falcon'"):
        load_model(str(path))


def test_missing_path_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(str(tmp_path / "nope.gguf"))


def _write_safetensors(path, header, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def _with_weights(hf_dir, tmp_path, header, data=b""):
    d = _copy(hf_dir, tmp_path / "m")
    _write_safetensors(d / "model.safetensors", header, data)
    return d


@pytest.mark.parametrize(
    "header, match",
    [
        ([1, 2, 3], r"header is a JSON list, expected an object"),
        ({"w": {"dtype": "F32", "shape": [2]}}, r"tensor 'w': no data_offsets"),
        ({"w": "F32"}, r"tensor 'w': expected an object with dtype, shape and data_offsets"),
        ({"w": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}, r"tensor 'w': unknown dtype 'F33'"),
        ({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, r"tensor 'w': shape \[-2\]"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, r"tensor 'w': data_offsets \[8, 0\]"),
        ({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, r"'w'.* 8 bytes.* needs 12"),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            r"tensors 'a' and 'b' overlap",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
            },
            r"gap before tensor 'a'",
        ),
        ({"__metadata__": [1]}, r"__metadata__"),
    ],
)
def test_malformed_safetensors_header_is_a_named_error(hf_dir, tmp_path, header, match):
    d = _with_weights(hf_dir, tmp_path, header, b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*" + match):
        load_model(str(d))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: [], r"config\.json: expected a JSON object, got a list"),
        (lambda c: {**c, "num_attention_heads": 0}, r"'num_attention_heads' is 0, expected an integer >= 1"),
        (lambda c: {**c, "hidden_size": "64"}, r"'hidden_size' is '64', expected an integer >= 1"),
        (lambda c: {**c, "num_key_value_heads": 3}, r"4 attention heads .* 3 key/value heads"),
        (lambda c: {**c, "architectures": "LlamaForCausalLM"}, r"'architectures' .* list of names"),
        (lambda c: {**c, "max_position_embeddings": 2**40}, r"'max_position_embeddings'"),
        (lambda c: {**c, "rope_scaling": [1]}, r"config\.json: "),
    ],
)
def test_malformed_config_json_is_a_named_error(hf_dir, tmp_path, edit, match):
    d = _copy(hf_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(edit(config)))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d))


def _gguf_tensor_offsets(path):
    """{tensor name: (byte position of its offset field in the file, offset)} from GGUFReader."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out = {}
    for tensor in reader.tensors:
        field = tensor.field
        offset_part = field.parts[-1]  # the uint64 data offset, relative to the data section
        out[tensor.name] = (int(offset_part.ctypes.data - reader.data.ctypes.data), int(offset_part[0]))
    return out


def test_gguf_with_overlapping_tensors_is_a_named_error(tmp_path):
    """A GGUF whose tensor ranges overlap loaded and generated empty text without complaint."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(), path)
    offsets = _gguf_tensor_offsets(path)
    names = sorted(offsets, key=lambda n: offsets[n][1])
    position, _ = offsets[names[1]]
    data = bytearray(path.read_bytes())
    data[position : position + 8] = offsets[names[0]][1].to_bytes(8, "little")  # second starts at the first
    broken = tmp_path / "overlap.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"overlap\.gguf: tensors .* overlap"):
        load_model(str(broken))


def test_gguf_tensor_relabelled_to_a_smaller_type_is_a_named_error(tmp_path):
    """blk.0.attn_k written as Q4_1 (20 bytes a block), its type field changed to Q4_0 (18): the tensor
    claims 1152 of its 1280 bytes and the next one starts where it always did. It loaded and moved
    the logits by 1.25 (relative), no error."""
    from gguf import GGUFReader

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny_llama(), path)
    reader = GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    type_field = int(tensor.field.parts[-2].ctypes.data - reader.data.ctypes.data)
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[type_field : type_field + 4], "little") == 3  # Q4_1
    data[type_field : type_field + 4] = (2).to_bytes(4, "little")  # Q4_0
    broken = tmp_path / "relabelled.gguf"
    broken.write_bytes(bytes(data))
    with pytest.raises(
        ModelLoadError, match=r"relabelled\.gguf: tensor 'blk\.0\.attn_k\.weight' ends 128 bytes"
    ):
        load_model(str(broken))


def test_gguf_with_implausible_metadata_is_a_named_error(tmp_path):
    for key, value, match in [
        ("llama.attention.head_count", 0, r"llama\.attention\.head_count.* 0"),
        ("llama.context_length", 2**40, r"context_length"),
        ("llama.embedding_length", "wide", r"llama\.embedding_length"),
    ]:
        path = tmp_path / f"bad_{key}.gguf"
        write_tiny_gguf(tiny_llama(), path, overrides={key: value})
        with pytest.raises(ModelLoadError, match=match):
            load_model(str(path))


def _saved(hf, directory, hf_dir):
    hf.save_pretrained(directory)
    (directory / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    return str(directory)


@pytest.mark.parametrize("overrides", [dict(attention_bias=True), dict(mlp_bias=True)])
def test_llama_attention_and_mlp_biases_are_read_as_transformers_does(hf_dir, tmp_path, overrides):
    """transformers' Llama with attention_bias has an o_proj bias as well as q/k/v ones, and mlp_bias
    gives gate/up/down biases: Kiln read only q/k/v's and ran without the others (relative logit error
    0.12 / 0.48, no error)."""
    from tests.models.helpers import prompt_logits

    hf = tiny_llama(**overrides)  # every parameter random, biases included
    loaded = load_model(_saved(hf, tmp_path / "m", hf_dir), cpu_format="fp32", lm_head_format="fp32")
    ids = [3, 17, 29, 4, 60, 11, 2, 45]
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
    got = prompt_logits(loaded.model, ids)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-5


def test_tensors_of_the_layers_the_model_does_not_read_are_a_named_error(hf_dir, tmp_path):
    """A tensor of a layer the model class does not know (here a quantization scale that no
    quantization_config covers) would be dropped and the model run without it."""
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(64, 1)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ModelLoadError, match=r"not read by Kiln's LlamaForCausalLM .*down_proj\.weight_scale"
    ):
        load_model(str(d))


def test_unread_tensors_outside_the_layers_are_a_warning_rope_tables_ignored(hf_dir, tmp_path, caplog):
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # older checkpoints saved it
    tensors["vision_tower.proj.weight"] = torch.ones(2, 2)
    # an FP8 checkpoint's KV-cache scales are kept (LoadedModel.kv_scales, for kv_cache_scales
    # "checkpoint"); an attention scale Kiln has no use for (q_proj.output_scale) is unused, a warning
    tensors["model.layers.1.self_attn.k_scale"] = torch.ones(())
    tensors["model.layers.1.self_attn.v_proj.v_scale"] = torch.ones(())
    tensors["model.layers.1.self_attn.q_proj.output_scale"] = torch.ones(())
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING", logger="kiln.loaders"):
        loaded = load_model(str(d))
    assert "vision_tower.proj.weight" in caplog.text and "q_proj.output_scale" in caplog.text
    assert "self_attn.k_scale" not in caplog.text and "v_proj.v_scale" not in caplog.text
    assert [(k[0], v[0]) for k, v in loaded.kv_scales.layers[1:]] == [
        ("model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_proj.v_scale")
    ]
    assert "inv_freq" not in caplog.text


def test_a_pipeline_stage_checks_the_tensors_of_its_own_layers_only(hf_dir, tmp_path):
    """A stage reads its layers only: an unread tensor of another stage's layer is that stage's to
    report, one of its own is an error (ranks skipped the check altogether)."""
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale"] = torch.ones(64, 1)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    load_model(str(d), pipeline_layers=(0, 1))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load_model(str(d), pipeline_layers=(1, 2))


def test_an_expert_parallel_rank_does_not_report_other_ranks_experts():
    from kiln.loaders import check_all_read
    from kiln.models.config import ModelConfig
    from kiln.models.weights import WeightStore

    config = ModelConfig.from_hf(
        dict(
            architectures=["Qwen2MoeForCausalLM"],
            num_attention_heads=4,
            hidden_size=64,
            vocab_size=100,
            intermediate_size=128,
            num_hidden_layers=2,
        )
    )
    names = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.1.mlp.gate.weight_scale"]
    store = WeightStore("ckpt", {name: ((1,), lambda: torch.ones(1)) for name in names})
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) .*mlp\.gate\.weight_scale$"):
        check_all_read(store, config, experts_split=True)
    with pytest.raises(ModelLoadError, match=r"2 tensor\(s\)"):
        check_all_read(store, config)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported by LlamaForCausalLM"),
        ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, r"layer_types .* per layer \(2\)"),
        ({"layer_types": ["full_attention", "chunked_attention"]}, r"layer_types .*chunked_attention"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"config\.json: rope scaling type 'yarn'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"config\.json: rope scaling type 'dynamic'"),
    ],
)
def test_config_settings_kiln_does_not_run_are_named(hf_dir, tmp_path, edit, match):
    d = _copy(hf_dir, tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d))


def test_a_gemma3_config_without_tie_word_embeddings_ties_them_as_transformers_does():
    from kiln.models.config import ModelConfig

    base = dict(
        num_attention_heads=4, hidden_size=64, vocab_size=100, intermediate_size=128, num_hidden_layers=2
    )
    gemma = ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **base})
    llama = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **base})
    assert gemma.tie_word_embeddings and not llama.tie_word_embeddings


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory, hf_dir):
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128,
    )  # fmt: skip
    return _saved(transformers.Qwen3MoeForCausalLM(config).eval(), tmp_path_factory.mktemp("moe"), hf_dir)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok = 5, expected an integer 1\.\.4"),
        ({"num_experts_per_tok": 0}, r"num_experts_per_tok = 0"),
        ({"num_experts_per_tok": None}, r"'num_experts_per_tok' is missing"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step = 0"),
        ({"mlp_only_layers": [7]}, r"mlp_only_layers = \[7\]"),
    ],
)
def test_mixture_of_experts_keys_out_of_range_are_named(qwen3_moe_dir, tmp_path, edit, match):
    """They were a KeyError, a ZeroDivisionError, a top-k past the expert count in the first forward,
    or (top-k 0) a model that loaded."""
    d = _copy(Path(qwen3_moe_dir), tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(d))


def test_an_integer_tensor_under_a_float_weight_name_is_a_named_error(hf_dir, tmp_path):
    """q_proj stored as int32 (or bool) was converted to float and run (relative logit error ~0.5)."""
    d = _copy(hf_dir, tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].round().to(torch.int32)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"q_proj\.weight' is int32, expected a floating-point tensor"):
        load_model(str(d))
