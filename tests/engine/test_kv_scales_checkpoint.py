"""EngineConfig(kv_cache_scales="checkpoint"): an fp8 KV cache on the k / v scales a quantized checkpoint
ships (kiln.loaders.kv_scales -> LoadedModel.kv_scales -> kiln.engine.kv_scales.engine_kv_calibration ->
the ModelRunner's LayerKVCache), as vLLM uses them.

The checkpoints are tiny random Llamas written by compressed-tensors (tests/loaders/ct_checkpoints.py:
W4A16 weights and an FP8 kv_cache_scheme, per tensor or per kv head; the library's own initialize_qparams
and calculate_qparams make the k_scale / v_scale tensors, since its apply_quantization_config cannot find
transformers 5's attention modules). Their convention, vLLM's: stored fp8 = value / scale, so Kiln's
fp8 cache must hold exactly what compressed-tensors' `quantize` gives for the same keys and scales."""

import json
import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.engine import LLM, EngineConfig, SamplingParams
from kiln.engine.kv_cache_args import add_kv_cache_arguments, kv_cache_config_from_args
from kiln.engine.kv_scales import engine_kv_calibration, prefill_keys_values
from kiln.loaders import load_model
from kiln.models.calibration import prefill
from kiln.models.config import ModelLoadError

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from tests.loaders.ct_checkpoints import CONFIG, write_kv_scaled_llama  # noqa: E402

STRATEGIES = ("tensor", "attn_head")
FP8 = dict(device="cpu", num_kv_blocks=96, kv_cache_dtype="fp8", kv_cache_scales="checkpoint")


@pytest.fixture(scope="module", params=STRATEGIES)
def checkpoint(request, tmp_path_factory):
    """(strategy, path) of a checkpoint with an FP8 kv_cache_scheme."""
    return request.param, write_kv_scaled_llama(tmp_path_factory.mktemp(request.param), request.param)


def _stored_scales(path: str) -> dict[str, torch.Tensor]:
    tensors = load_file(f"{path}/model.safetensors")
    return {
        name: t for name, t in tensors.items() if name.endswith(("self_attn.k_scale", "self_attn.v_scale"))
    }


def _prompts(count: int, seed: int = 1) -> list[list[int]]:
    """Random token ids, 96-127 a prompt: past the first block and the 32 exact positions, so most of
    each step's keys are read from the fp8 cache."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(96, 128, (count,), generator=generator).tolist()
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


def test_the_fp8_cache_uses_the_checkpoints_scales(checkpoint, caplog):
    strategy, path = checkpoint
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = LLM(path, **FP8)
    stored = _stored_scales(path)
    heads = CONFIG["num_key_value_heads"]
    for i, layer in enumerate(llm.engine.runner.kv_caches):
        for kind, used in (("k", layer.k_scale), ("v", layer.v_scale)):
            tensor = stored[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert tensor.shape == ((1,) if strategy == "tensor" else (heads, 1, 1))
            assert used.dtype == torch.float32 and used.shape == (heads,)
            assert torch.equal(used, tensor.float().reshape(-1).expand(heads))
        assert layer.k_shift is None  # a checkpoint's keys are stored as they are, not centred
    assert "float8_e4m3fn (checkpoint scales)" in llm.engine.runner.kv_cache_description()
    assert f"the k/v scales {path} ships (2 layers)" in caplog.text


def test_the_fp8_cache_holds_compressed_tensors_quantization_of_keys_and_values(checkpoint):
    """Layer 0's keys and values (the same float32 arithmetic with any cache) written into the engine's
    fp8 cache equal compressed-tensors' `quantize` of them with the checkpoint's scales and its
    kv_cache_scheme, element for element. Under the opposite convention (stored = value * scale) or with
    Kiln's own scales nearly every element would differ."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize

    _, path = checkpoint
    with open(f"{path}/config.json") as f:
        args = QuantizationArgs.model_validate(json.load(f)["quantization_config"]["kv_cache_scheme"])
    stored = _stored_scales(path)
    llm = LLM(path, **FP8, kv_cache_exact_window=None)
    model, caches = llm.engine.model, llm.engine.runner.kv_caches
    ids = _prompts(1)[0]
    keys, values = prefill_keys_values(model, ids)[0]  # float32 [T, Hkv, D]
    prefill(model, ids, kv_caches=caches)  # blocks 0, 1, ... of the engine's cache: slot = position
    T = len(ids)
    for kind, exact, cache in (("k", keys, caches[0].key_cache), ("v", values, caches[0].value_cache)):
        scale = stored[f"model.layers.0.self_attn.{kind}_scale"].float()
        # compressed-tensors' layout: [Hkv, T, D] against a [1] or [Hkv, 1, 1] scale
        theirs = quantize(exact.transpose(0, 1), scale, torch.zeros_like(scale), args, torch.float8_e4m3fn)
        ours = cache.reshape(-1, *cache.shape[2:])[:T].transpose(0, 1)
        assert ours.dtype == theirs.dtype == torch.float8_e4m3fn
        assert torch.equal(ours.float(), theirs.float()), kind


NEAR_TIE = 0.2


def test_greedy_tokens_follow_the_16_bit_caches_up_to_near_ties(checkpoint):
    """The engine as it runs by default on an fp8 cache (first block and last 32 positions exact) with
    the checkpoint's scales, against a float16 cache (which gives the float32 cache's tokens here):
    greedy tokens are equal up to the first position where the float16 run's top two logprobs are within
    NEAR_TIE, and over all prompts at least 32 of 128 leading tokens are. A random 2-layer Llama over a
    128-token vocabulary has near ties everywhere (a quarter of its steps are within 0.2). Measured on an
    AMD EPYC host over these 8 prompts (96-127 tokens, 16 new tokens), leading equal tokens of 128: 88
    per tensor, 59 per head (scales 1.0: 80), every part at a float16 top-two gap <= 0.084 (<= 0.143 over
    16 prompts and 24 tokens); with the checkpoint's scales / 8 (values past an eighth of the calibration
    peak saturate) 6 of 128, parting at gaps up to 0.56. e4m3 is a floating-point format, so a scale
    moves its range, not its precision: this does not tell a scale from 1.0 (the test above checks the
    convention); it shows the fp8 cache reads back what the checkpoint's scales wrote."""
    _, path = checkpoint
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
    reference = LLM(path, device="cpu", num_kv_blocks=96, kv_cache_dtype="float16").generate(prompts, params)
    outputs = LLM(path, **FP8).generate(prompts, params)
    leading = 0
    for ref, out in zip(reference, outputs, strict=True):
        n = next(
            (i for i, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)) if a != b),
            len(ref.token_ids),
        )
        leading += n
        if n < len(ref.token_ids):
            top = sorted(ref.logprobs[n].values(), reverse=True)
            assert top[0] - top[1] < NEAR_TIE, (n, ref.token_ids, out.token_ids, top)
    assert leading >= 32, leading


def test_a_checkpoint_without_kv_scales_is_a_named_error(tmp_path):
    path = write_kv_scaled_llama(tmp_path, None)
    with pytest.raises(
        ValueError,
        match=rf"kv_cache_scales='checkpoint', but {re.escape(path)} ships no KV-cache scales "
        r".*self_attn\.k_scale.*use kv_cache_scales 'calibrated' \(the default\) or 'unit'",
    ):
        LLM(path, **FP8)
    assert load_model(path).kv_scales is None


def _broken(source: str, directory, edit) -> str:
    """A copy of checkpoint `source` with `edit(tensors)` applied to its safetensors."""
    import shutil

    shutil.copytree(source, directory)
    tensors = load_file(f"{directory}/model.safetensors")
    edit(tensors)
    save_file(tensors, f"{directory}/model.safetensors", metadata={"format": "pt"})
    return str(directory)


def _set(name: str, value: torch.Tensor):
    return lambda tensors: tensors.__setitem__(name, value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            _set("model.layers.1.self_attn.k_scale", torch.full((3,), 0.01)),
            r"KV-cache scale 'model\.layers\.1\.self_attn\.k_scale' has 3 elements, expected 1 "
            r"\(per tensor\) or num_kv_heads=2 \(per head\)",
        ),
        (
            _set("model.layers.0.self_attn.v_scale", torch.tensor([float("nan")])),
            r"KV-cache scale 'model\.layers\.0\.self_attn\.v_scale' holds nan, expected finite values > 0",
        ),
        (
            _set("model.layers.1.self_attn.v_scale", torch.tensor([float("inf")])),
            r"'model\.layers\.1\.self_attn\.v_scale' holds inf",
        ),
        (
            _set("model.layers.0.self_attn.k_scale", torch.zeros(1)),
            r"'model\.layers\.0\.self_attn\.k_scale' holds 0\.0",
        ),
        (
            _set("model.layers.0.self_attn.k_scale", torch.tensor([0.01, -0.02])),
            r"'model\.layers\.0\.self_attn\.k_scale' holds -0\.0199",
        ),
        (
            lambda tensors: tensors.pop("model.layers.1.self_attn.v_scale"),
            r"decoder layer 1 has no v scale for the KV cache \(looked for "
            r"'model\.layers\.1\.self_attn\.v_scale'",
        ),
    ],
    ids=["shape", "nan", "inf", "zero", "negative", "missing"],
)
def test_a_bad_scale_tensor_is_a_named_error_with_checkpoint_scales_only(checkpoint, tmp_path, edit, message):
    """Checked when the cache uses them: a cache that keeps its own scales loads the same checkpoint."""
    path = _broken(checkpoint[1], tmp_path / "broken", edit)
    with pytest.raises(ModelLoadError, match=message) as error:
        LLM(path, **FP8)
    assert path in str(error.value)
    LLM(path, **{**FP8, "kv_cache_scales": "calibrated"})


def test_a_16_bit_cache_ignores_checkpoint_scales_and_says_so(checkpoint, caplog):
    """As "calibrated" and "unit" are ignored by a cache without scales; the one choice that names the
    checkpoint's scales is logged as ignored, with the flag that uses them."""
    with caplog.at_level(logging.WARNING, logger="kiln.engine.kv_scales"):
        llm = LLM(checkpoint[1], **{**FP8, "kv_cache_dtype": "float16"})
    layer = llm.engine.runner.kv_caches[0]
    assert layer[0].dtype == torch.float16 and len(layer) == 2  # (key_cache, value_cache), no scales
    assert (
        "kv_cache_scales='checkpoint' applies to an fp8 KV cache; this float16 cache ignores it"
        in caplog.text
    )
    assert "kv_cache_dtype 'fp8' uses the checkpoint's scales" in caplog.text


@pytest.mark.parametrize("choice", ["calibrated", "unit"])
def test_other_fp8_scales_on_a_checkpoint_with_kv_scales_log_one_info_line(checkpoint, caplog, choice):
    """The default stays "calibrated"; the checkpoint's scales are then unused, and the log says how to
    use them (once). A checkpoint without them logs nothing of the kind."""
    assert EngineConfig().kv_cache_scales == "calibrated"
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = LLM(checkpoint[1], **{**FP8, "kv_cache_scales": choice})
    line = (
        f"fp8 KV cache: {checkpoint[1]} ships k/v scales, not used (kv_cache_scales={choice!r}); "
        "kv_cache_scales 'checkpoint' (--kv-cache-scales checkpoint) uses them"
    )
    assert caplog.text.count(line) == 1
    assert "checkpoint scales" not in llm.engine.runner.kv_cache_description()
    assert "not used (kv_cache_scales" not in caplog.text.replace(line, "")


def test_a_pipeline_stage_uses_the_checkpoint_scales_of_its_own_layers(checkpoint):
    """A stage holds layers [1, 2): it reads their scales only and, with nothing to calibrate on, takes
    them as they are (calibrated scales stay 1.0 there)."""
    _, path = checkpoint
    stage = load_model(path, pipeline_layers=(1, 2))
    assert [(k[0], v[0]) for k, v in stage.kv_scales.layers] == [
        ("model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale")
    ]
    config = EngineConfig(model=path, kv_cache_dtype="fp8", kv_cache_scales="checkpoint")
    scales = engine_kv_calibration(
        config, stage.model, stage.tokenizer, torch.float8_e4m3fn, True, checkpoint_scales=stage.kv_scales
    )
    stored = _stored_scales(path)
    assert len(scales) == 1 and scales[0][2] is None
    assert torch.equal(scales[0][1], stored["model.layers.1.self_attn.v_scale"].reshape(-1).expand(2))


def test_the_flag_reaches_the_engine_config_from_generate_serve_and_bench_engine():
    import argparse

    from kiln.cli import build_parser

    for command in (["generate", "hi"], ["serve"], ["bench", "engine"]):
        args = build_parser().parse_args(
            [*command, "--kv-cache-dtype", "fp8", "--kv-cache-scales", "checkpoint"]
        )
        assert EngineConfig(**kv_cache_config_from_args(args)).kv_cache_scales == "checkpoint"
    parser = argparse.ArgumentParser()
    add_kv_cache_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    assert "checkpoint = the k/v scales a quantized checkpoint ships" in help_text


def test_tensor_parallel_ranks_use_their_heads_checkpoint_scales(tmp_path):
    """TP 2 over per-head checkpoint scales (FP8 weights, which shard exactly; each rank one kv head)
    gives TP 1's logits: measured 1.8e-7 apart, while scales 1.0 are 6.6e-2 from them, so a rank on
    another head's scale, on scales 1.0 or without the checkpoint's (an error) would show."""
    from kiln.engine import LLMEngine
    from kiln.verify import relative_error
    from tests.distributed.checkpoints import record_logits, run_tensor_parallel, run_to_completion

    path = write_kv_scaled_llama(tmp_path, "attn_head", preset="FP8")
    # 40 + 4 tokens with a window of 4: positions 16-35 and on are read from the fp8 cache only
    prompts = [list(range(3, 43)), [2, 3, 4]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    options = dict(model=path, device="cpu", num_kv_blocks=32, kv_cache_dtype="fp8", kv_cache_exact_window=4)
    runs = {}
    for choice in ("checkpoint", "unit"):
        engine = LLMEngine(EngineConfig(**options, kv_cache_scales=choice))
        logits = record_logits(engine)
        runs[choice] = (run_to_completion(engine, prompts, greedy), logits)
    head_0 = _stored_scales(path)["model.layers.0.self_attn.k_scale"].reshape(-1)[:1]

    def rank_0_holds_head_0(tp):
        assert torch.equal(tp.runner.kv_caches[0].k_scale, head_0)

    config = EngineConfig(**options, kv_cache_scales="checkpoint")
    tp_tokens, tp_logits = run_tensor_parallel(config, prompts, greedy, rank_0_holds_head_0)
    tokens, logits = runs["checkpoint"]
    assert tp_tokens == tokens
    tp_error = max(relative_error(a, b) for a, b in zip(tp_logits, logits, strict=True))
    unit_error = max(relative_error(a, b) for a, b in zip(runs["unit"][1], logits, strict=True))
    assert tp_error < 1e-3 * unit_error, (tp_error, unit_error)
