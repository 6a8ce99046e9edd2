"""Broken checkpoints fail with a ModelLoadError (a ValueError) that names the file and the tensor:
truncated GGUF and safetensors files, garbage files, missing tensors, mismatched shapes, unknown
architectures, pickle-only directories."""

import json
import os

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
