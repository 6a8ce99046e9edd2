"""Calibration of an fp8 KV cache on the model itself: per layer and kv head, the keys' mean (the shift
subtracted from every key before it is stored) and the scales of keys and values.

float8_e4m3fn rounds to 2^-4 of a value's magnitude, so the error of a stored key grows with |k|. Keys
carry a large common part per channel (in SmolLM2-135M their RMS over a prefill is 1.3-2.4, centred
0.9-1.6); subtracting it is exact for attention, because q.(k - s) = q.k - q.s moves every score of a
query by the same amount and softmax ignores that, and it cuts the keys' fp8 error by ~1.7x (2.7% -> 1.5%
RMS relative). Values cannot be shifted without correcting the output and gain little from it.

The scales put each head's peak (times a headroom) at e4m3's largest finite value, 448, so the cache
uses the normal range (below 2^-6 of the scale e4m3 goes subnormal and loses bits). Values beyond the
headroom later saturate at +-448 * scale: the cache writers clamp before casting.
"""

from __future__ import annotations

import logging

import torch

from kiln.loaders.kv_scales import CheckpointKVScales
from kiln.models.calibration import prefill, read_text
from kiln.ops.attention.validate import FP8_DTYPES

FP8_E4M3_MAX = 448.0
logger = logging.getLogger(__name__)

DEFAULT_HEADROOM = 2.0  # keys/values up to twice the calibration peak stay unsaturated
DEFAULT_CALIBRATION_TOKENS = 512
# Fewer distinct ids than this in the calibration text's encoding: the tokenizer cannot write the text
# (a toy word-level vocabulary makes all of it one unknown token), so its peaks are a few tokens' and
# the prompts' keys and values pass the headroom; the engine keeps unit scales instead.
MIN_DISTINCT_CALIBRATION_TOKENS = 16


def calibration_token_ids(tokenizer, max_tokens: int = DEFAULT_CALIBRATION_TOKENS) -> list[int]:
    """The first `max_tokens` token ids of Kiln's shipped calibration text (prose, Q&A and code)."""
    ids = tokenizer.encode(read_text("calibration.txt"), add_special_tokens=True)
    return ids[:max_tokens]


def prefill_keys_values(
    model: torch.nn.Module, token_ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), float32 [T, num_kv_heads, head_dim]: what `model` writes into its KV
    cache (of its own dtype) while prefilling `token_ids`, after RoPE."""
    caches = prefill(model, token_ids, return_kv_caches=True)[1]
    T = len(token_ids)
    out = []
    for key_cache, value_cache in caches:
        heads, dim = key_cache.shape[2], key_cache.shape[3]
        # the prefill lays blocks out in order: position p sits at slot p
        out.append(tuple(c.reshape(-1, heads, dim)[:T].float() for c in (key_cache, value_cache)))
    return out


def _scale(peak: torch.Tensor, headroom: float) -> torch.Tensor:
    # a head that never fires (peak 0) keeps 1.0
    return torch.where(peak > 0, peak * (headroom / FP8_E4M3_MAX), 1.0)


def calibrate_kv_cache(
    model: torch.nn.Module, token_ids: list[int], headroom: float = DEFAULT_HEADROOM
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer (k_scale [Hkv], v_scale [Hkv], k_shift [Hkv, head_dim]), float32 on the CPU: k_shift the
    keys' mean over `token_ids`, k_scale = headroom * max |k - k_shift| / 448, v_scale = headroom *
    max |v| / 448 (stored = (value - shift) / scale). `model` is run once, outside any engine."""
    if headroom < 1.0:
        raise ValueError(f"calibrate_kv_cache: headroom={headroom}, expected >= 1 (below it, peaks saturate)")
    if len(token_ids) < 2:
        raise ValueError(f"calibrate_kv_cache: {len(token_ids)} calibration tokens, expected at least 2")
    out = []
    for keys, values in prefill_keys_values(model, token_ids):
        shift = keys.mean(dim=0)
        k_scale = _scale((keys - shift).abs().amax(dim=(0, 2)), headroom)
        v_scale = _scale(values.abs().amax(dim=(0, 2)), headroom)
        out.append((k_scale.cpu(), v_scale.cpu(), shift.cpu()))
    return out


def engine_kv_calibration(
    config,
    model: torch.nn.Module,
    tokenizer,
    kv_cache_dtype: torch.dtype,
    pipeline: bool = False,
    checkpoint_scales: CheckpointKVScales | None = None,
):
    """ModelRunner's kv_calibration for an engine, per layer (k_scale, v_scale, k_shift or None), or None
    (scales 1.0). For an fp8 cache, by config.kv_cache_scales:
      "calibrated": calibrate_kv_cache on Kiln's calibration text (None when the tokenizer writes that
        text as fewer than MIN_DISTINCT_CALIBRATION_TOKENS distinct ids, logged);
      "checkpoint": the scales the checkpoint ships (`checkpoint_scales`, LoadedModel.kv_scales, for the
        layers and kv heads this model holds), no key shift; ValueError when it ships none;
      "unit": None.
    Another cache ignores kv_cache_scales ("checkpoint" says so in the log). Under tensor parallelism every
    rank calls it at the same point (the calibration prefill's collectives pair up) and gets its own
    heads; a pipeline stage holds only some layers, so there (`pipeline`) calibration is skipped (scales
    1.0, logged) while the checkpoint's scales of the stage's layers apply as they are."""
    choice = config.kv_cache_scales
    if kv_cache_dtype not in FP8_DTYPES:
        if choice == "checkpoint":
            logger.warning(
                "kv_cache_scales='checkpoint' applies to an fp8 KV cache; this %s cache ignores it "
                "(kv_cache_dtype 'fp8' uses the checkpoint's scales)",
                str(kv_cache_dtype).removeprefix("torch."),
            )
        return None
    if choice == "checkpoint":
        return checkpoint_kv_calibration(config, checkpoint_scales)
    if checkpoint_scales is not None:
        logger.info(
            "fp8 KV cache: %s ships k/v scales, not used (kv_cache_scales=%r); kv_cache_scales 'checkpoint' "
            "(--kv-cache-scales checkpoint) uses them",
            checkpoint_scales.source,
            choice,
        )
    if choice != "calibrated":
        return None
    if pipeline:
        logger.warning("fp8 KV cache under pipeline parallelism: scales 1.0, keys not centred")
        return None
    token_ids = calibration_token_ids(tokenizer)
    distinct = len(set(token_ids))
    if distinct < MIN_DISTINCT_CALIBRATION_TOKENS:
        logger.warning(
            "fp8 KV cache: the tokenizer writes the calibration text as %d distinct tokens (fewer than "
            "%d, e.g. all unknown), too few to measure the keys and values: scales 1.0, keys not centred",
            distinct,
            MIN_DISTINCT_CALIBRATION_TOKENS,
        )
        return None
    return calibrate_kv_cache(model, token_ids)


def checkpoint_kv_calibration(
    config, checkpoint_scales: CheckpointKVScales | None
) -> list[tuple[torch.Tensor, torch.Tensor, None]]:
    """Per layer (k_scale, v_scale float32 [num_kv_heads], None): the checkpoint's scales as the fp8 cache
    takes them (stored = value / scale, the convention of compressed-tensors and vLLM), keys not
    shifted. ValueError naming the checkpoint when it ships none; ModelLoadError naming the tensor for a
    scale of another shape or not finite and > 0 (CheckpointKVScales.per_head)."""
    if checkpoint_scales is None:
        raise ValueError(
            f"EngineConfig: kv_cache_scales='checkpoint', but {config.model or 'the model'} ships no "
            "KV-cache scales (no model.layers.N.self_attn.k_scale / v_scale tensors, as a compressed-tensors "
            "checkpoint with a kv_cache_scheme has); use kv_cache_scales 'calibrated' (the default) or 'unit'"
        )
    scales = [(k, v, None) for k, v in checkpoint_scales.per_head()]
    logger.info("fp8 KV cache: the k/v scales %s ships (%d layers)", checkpoint_scales.source, len(scales))
    return scales
