"""Broken checkpoints fail with a ModelLoadError (a ValueError) that names the file and the tensor:
truncated GGUF and safetensors files, garbage files, missing tensors, mismatched shapes, unknown
architectures, pickle-only directories."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.loaders import load_model
from kiln.models import ModelLoadError
from tests.loaders.gguf_tiny import write_tiny_gguf
from tests.loaders.test_gguf_loader import tiny_llama


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
