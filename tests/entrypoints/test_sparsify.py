"""`kiln sparsify`: 2:4 pruning of an HF checkpoint (magnitude, Wanda), written dense (any loader reads it:
transformers is the reference) or compressed (Kiln's layout), and the compressed checkpoint generating
the same tokens through Kiln as the dense one holding the same pruned weights."""

import json

import pytest
import torch
from safetensors import safe_open

from kiln.cli import main as kiln_main
from kiln.entrypoints.sparsify import sparsify
from kiln.quant.sparse24 import decompress_24, is_24_sparse

transformers = pytest.importorskip("transformers")
checkpoints = pytest.importorskip("tests.distributed.checkpoints")

PROMPT = "t5 t17 t3 t99 t42 t8 t61"
CALIBRATION = " ".join(f"t{(7 * i) % 130}" for i in range(200))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return checkpoints.write_checkpoint(tmp_path_factory.mktemp("dense"), "llama", seed=3)


def tensors(directory):
    with safe_open(f"{directory}/model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_dense_output_is_2_4_and_transformers_loads_it(source, tmp_path):
    out = tmp_path / "pruned"
    assert kiln_main(["sparsify", source, "--out", str(out), "--dense", "--ignore", r"layers\.1\.mlp"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["sparsity_config"] == {"format": "dense", "method": "magnitude",
                                         "ignore": [r"layers\.1\.mlp"], "pruned": 11}  # fmt: skip
    before, after = tensors(source), tensors(out)
    assert set(before) == set(after)
    for name, weight in after.items():
        projection = ".layers." in name and name.endswith("_proj.weight")
        if projection and "layers.1.mlp" not in name:
            assert is_24_sparse(weight) and int((weight != 0).sum()) == weight.numel() // 2
            assert torch.equal(weight[weight != 0], before[name][weight != 0])
        else:
            assert torch.equal(weight, before[name])
    assert (out / "tokenizer.json").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(
        model.model.layers[0].self_attn.q_proj.weight.detach(),
        after["model.layers.0.self_attn.q_proj.weight"],
    )


def test_compressed_output_decompresses_to_the_dense_output(source, tmp_path):
    sparsify(source, str(tmp_path / "dense"), dense=True, progress=False)
    sparsify(source, str(tmp_path / "packed"), progress=False)
    dense, packed = tensors(tmp_path / "dense"), tensors(tmp_path / "packed")
    prefix = "model.layers.0.mlp.down_proj"
    assert f"{prefix}.weight" not in packed and packed[f"{prefix}.sparse24_meta"].dtype == torch.uint8
    for name, weight in dense.items():
        if name.endswith("_proj.weight"):
            stem = name[: -len(".weight")]
            values, meta = packed[f"{stem}.sparse24_values"], packed[f"{stem}.sparse24_meta"]
            assert values.dtype == weight.dtype and torch.equal(decompress_24(values, meta), weight)
        else:
            assert torch.equal(packed[name], weight)
    config = json.loads((tmp_path / "packed" / "config.json").read_text())
    assert config["sparsity_config"]["format"] == "kiln-sparse-2:4"


def test_wanda_differs_from_magnitude(source, tmp_path):
    sparsify(source, str(tmp_path / "m"), dense=True, progress=False)
    sparsify(source, str(tmp_path / "w"), "wanda", calibration_text=CALIBRATION, dense=True, progress=False)
    magnitude, wanda = tensors(tmp_path / "m"), tensors(tmp_path / "w")
    changed = [n for n in wanda if n.endswith("_proj.weight") and not torch.equal(wanda[n], magnitude[n])]
    assert changed and all(is_24_sparse(wanda[n]) for n in changed)


def test_bad_arguments_are_named(source, tmp_path, capsys):
    assert kiln_main(["sparsify", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert kiln_main(["sparsify", source, "--out", source]) == 2
    assert "--out must differ" in capsys.readouterr().err


def _greedy(model_dir, **kwargs):
    from kiln.engine import LLM, SamplingParams

    llm = LLM(model=model_dir, device="cpu", dtype=torch.float32, num_kv_blocks=16, **kwargs)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    (out,) = llm.generate([PROMPT], params)
    return llm, out


def test_compressed_checkpoint_generates_what_the_dense_pruned_one_does(source, tmp_path, monkeypatch):
    """Through LLM(...): the compressed checkpoint (CPU: expanded once at load) and one where the 2:4
    layout is kept and every projection runs sparse24_linear (the CUDA path, forced here) generate the
    dense pruned checkpoint's greedy tokens, with its logprobs."""
    from kiln.ops.gemm import weight_formats
    from kiln.ops.gemm.quantized_layouts import sparse24_layout
    from kiln.quant.sparse24 import Sparse24Weight

    sparsify(source, str(tmp_path / "dense"), dense=True, progress=False)
    sparsify(source, str(tmp_path / "packed"), progress=False)
    _, dense = _greedy(str(tmp_path / "dense"))
    llm, packed = _greedy(str(tmp_path / "packed"))
    assert llm.engine.model.layers[0].self_attn.qkv_proj.format == "dense"  # expanded on the CPU
    original = weight_formats._prepare_quantized

    def keep_sparse(weight, shape, device, dtype, cpu_format):
        if isinstance(weight, Sparse24Weight):
            layout, tensors = sparse24_layout(weight, device, dtype)
            return weight_formats.PreparedLinearWeight(layout, tensors, shape, dtype, dtype)
        return original(weight, shape, device, dtype, cpu_format)

    monkeypatch.setattr(weight_formats, "_prepare_quantized", keep_sparse)
    llm, kernel = _greedy(str(tmp_path / "packed"))
    model = llm.engine.model
    assert {layer.self_attn.qkv_proj.format for layer in model.layers} == {"sparse24"}
    assert {layer.mlp.down_proj.format for layer in model.layers} == {"sparse24"}
    assert packed.token_ids == dense.token_ids == kernel.token_ids
    for a, b in zip(dense.logprobs, kernel.logprobs, strict=True):
        token = next(iter(a))
        assert b[token] == pytest.approx(a[token], abs=1e-4)


def test_loader_names_a_bad_sparse_checkpoint(source, tmp_path):
    from kiln.loaders.safetensors import load_safetensors_dir
    from kiln.models import ModelLoadError

    out = tmp_path / "packed"
    sparsify(source, str(out), progress=False)
    config = json.loads((out / "config.json").read_text())
    config["sparsity_config"]["format"] = "sparse-24-bitmask"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="sparsity_config format 'sparse-24-bitmask' is not supported"):
        load_safetensors_dir(str(out))
