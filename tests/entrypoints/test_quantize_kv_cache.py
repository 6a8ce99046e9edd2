"""`kiln quantize --kv-cache fp8` (kiln.entrypoints.quantize_kv_cache): the checkpoint's config carries
an FP8 kv_cache_scheme as the compressed-tensors library writes it (8-bit float, per tensor, static,
symmetric), every attention module a k_scale and v_scale equal to max |x| / 448 of the keys (after
RoPE) and values over the calibration tokens, checked against Kiln's own model prefilling the same
tokens (an implementation we did not use to write them), and `LLM(...)` with an fp8 cache and
kv_cache_scales="checkpoint" runs on exactly those scales."""

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from tests.distributed.checkpoints import write_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SHAPE = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(source dir, quantized dir, the calibration text)."""
    source = tmp_path_factory.mktemp("src")
    write_checkpoint(source, "llama", **SHAPE)
    text = " ".join(
        f"t{i}" for i in torch.randint(0, 130, (200,), generator=torch.Generator().manual_seed(2))
    )
    (source / "calibration.txt").write_text(text)
    out = tmp_path_factory.mktemp("q")
    argv = ["quantize", str(source), "--out", str(out), "--scheme", "fp8", "--kv-cache", "fp8",
            "--calibration", str(source / "calibration.txt"), "--max-calibration-tokens", "64"]  # fmt: skip
    assert main(argv) == 0
    return source, out, text


def test_kv_cache_scheme_and_scales_are_the_calibration_peaks_over_448(quantized):
    from kiln.engine.kv_scales import prefill_keys_values
    from kiln.loaders import load_model

    source, out, text = quantized
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"]) == (8, "float", "tensor")
    assert scheme["dynamic"] is False and scheme["symmetric"] is True
    assert config["kiln_quantize"]["kv_cache"] == "fp8"
    tensors = load_file(str(out / "model.safetensors"))
    ids = transformers.AutoTokenizer.from_pretrained(str(source))(text)["input_ids"][:64]
    loaded = load_model(
        str(source), device="cpu", dtype=torch.float32, cpu_format="fp32", lm_head_format="fp32"
    )
    observed = prefill_keys_values(loaded.model, ids)
    assert len(observed) == config["num_hidden_layers"]
    for i, (keys, values) in enumerate(observed):
        for kind, x in (("k", keys), ("v", values)):
            stored = tensors[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert stored.shape == (1,)
            torch.testing.assert_close(stored.float(), x.abs().amax().reshape(1) / 448.0, rtol=1e-5, atol=0)


def test_an_fp8_cache_runs_on_the_checkpoints_scales(quantized):
    from kiln.engine import LLM, SamplingParams

    _, out, _ = quantized
    tensors = load_file(str(out / "model.safetensors"))
    llm = LLM(model=str(out), device="cpu", dtype=torch.float32, num_kv_blocks=16, kv_cache_dtype="fp8",
              kv_cache_scales="checkpoint")  # fmt: skip
    for i, layer in enumerate(llm.engine.runner.kv_caches):
        k_scale, v_scale = layer[2], layer[3]
        assert torch.equal(k_scale, tensors[f"model.layers.{i}.self_attn.k_scale"].float().expand_as(k_scale))
        assert torch.equal(v_scale, tensors[f"model.layers.{i}.self_attn.v_scale"].float().expand_as(v_scale))
    (result,) = llm.generate(
        [[5, 77, 3, 101, 42]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    assert len(result.token_ids) == 4


def test_unknown_kv_cache_scheme_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            ["quantize", str(tmp_path), "--out", str(tmp_path / "o"), "--scheme", "fp8", "--kv-cache", "int8"]
        )
    assert "invalid choice: 'int8'" in capsys.readouterr().err
