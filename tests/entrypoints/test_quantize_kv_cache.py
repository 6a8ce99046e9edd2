"""`kiln quantize --kv-cache fp8` (kiln.entrypoints.quantize_kv_cache): the checkpoint's config carries
an FP8 kv_cache_scheme as the compressed-tensors library writes it (8-bit float, static, symmetric;
strategy "tensor" by default, "attn_head" with --kv-cache-strategy attn_head), every attention module a
k_scale and v_scale equal to max |x| / 448 of the keys (after RoPE) and values over the calibration
tokens (per tensor: [1]; per kv head: [num_kv_heads, 1, 1]), checked against Kiln's own model
prefilling the same tokens (an implementation we did not use to write them), and `LLM(...)` with an
fp8 cache and kv_cache_scales="checkpoint" runs on exactly those scales."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from kiln.cli import main
from tests.distributed.checkpoints import write_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

SHAPE = dict(hidden_size=128, intermediate_size=256, num_key_value_heads=2, max_position_embeddings=1024)
# --kv-cache-strategy (None: left out) -> the kv_cache_scheme's strategy and the dims of Kiln's
# [T, num_kv_heads, head_dim] keys / values a scale's peak is taken over
STRATEGIES = {None: ("tensor", (0, 1, 2)), "attn_head": ("attn_head", (0, 2))}


@pytest.fixture(scope="module", params=list(STRATEGIES))
def quantized(request, tmp_path_factory):
    """(source dir, quantized dir, the calibration text, the --kv-cache-strategy given or None)."""
    source = tmp_path_factory.mktemp("src")
    write_checkpoint(source, "llama", **SHAPE)
    text = " ".join(
        f"t{i}" for i in torch.randint(0, 130, (200,), generator=torch.Generator().manual_seed(2))
    )
    (source / "calibration.txt").write_text(text)
    out = tmp_path_factory.mktemp("q")
    argv = ["quantize", str(source), "--out", str(out), "--scheme", "fp8", "--kv-cache", "fp8",
            "--calibration", str(source / "calibration.txt"), "--max-calibration-tokens", "64"]  # fmt: skip
    if request.param is not None:
        argv += ["--kv-cache-strategy", request.param]
    assert main(argv) == 0
    return source, out, text, request.param


def test_kv_cache_scheme_and_scales_are_the_calibration_peaks_over_448(quantized):
    from kiln.engine.kv_scales import prefill_keys_values
    from kiln.loaders import load_model

    source, out, text, given = quantized
    strategy, reduce = STRATEGIES[given]
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"]) == (8, "float", strategy)
    assert scheme["dynamic"] is False and scheme["symmetric"] is True
    assert config["kiln_quantize"]["kv_cache"] == "fp8"
    assert config["kiln_quantize"]["kv_cache_strategy"] == strategy
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
            heads = x.shape[1]
            assert stored.shape == ((1,) if strategy == "tensor" else (heads, 1, 1))
            expected = x.abs().amax(reduce).reshape(stored.shape) / 448.0
            torch.testing.assert_close(stored.float(), expected, rtol=1e-5, atol=0)
            if strategy == "attn_head":  # else a per-tensor peak copied to every head would pass too
                assert len(set(stored.flatten().tolist())) == heads


def test_an_fp8_cache_runs_on_the_checkpoints_scales(quantized):
    from kiln.engine import LLM, SamplingParams

    _, out, _, _ = quantized
    tensors = load_file(str(out / "model.safetensors"))
    llm = LLM(model=str(out), device="cpu", dtype=torch.float32, num_kv_blocks=16, kv_cache_dtype="fp8",
              kv_cache_scales="checkpoint")  # fmt: skip
    for i, layer in enumerate(llm.engine.runner.kv_caches):
        for kind, scale in (("k", layer[2]), ("v", layer[3])):
            # [1] (per tensor) broadcast to every kv head, or [num_kv_heads, 1, 1] one per head
            stored = tensors[f"model.layers.{i}.self_attn.{kind}_scale"].float().reshape(-1)
            assert torch.equal(scale, stored.expand_as(scale))
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


def test_unknown_kv_cache_strategy_is_refused(tmp_path, capsys):
    argv = ["quantize", str(tmp_path), "--out", str(tmp_path / "o"), "--scheme", "fp8", "--kv-cache", "fp8",
            "--kv-cache-strategy", "channel"]  # fmt: skip
    with pytest.raises(SystemExit):
        main(argv)
    assert "invalid choice: 'channel'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kv_cache, strategy, message",
    [
        ("fp8", "channel", "--kv-cache-strategy 'channel' unsupported, expected one of tensor, attn_head"),
        (None, "attn_head", "--kv-cache-strategy applies with --kv-cache only"),
    ],
)
def test_quantize_refuses_a_bad_kv_cache_strategy_before_reading_the_checkpoint(
    tmp_path, kv_cache, strategy, message
):
    from kiln.entrypoints.quantize import quantize

    with pytest.raises(ValueError, match=re.escape(message)):
        quantize(str(tmp_path), str(tmp_path / "o"), "fp8", kv_cache=kv_cache, kv_cache_strategy=strategy)
