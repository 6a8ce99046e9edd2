"""The KV-cache command-line flags `kiln generate`, `kiln serve` and `kiln bench engine` share."""

from __future__ import annotations

import argparse

from kiln.engine.config import KV_CACHE_DTYPES, KV_CACHE_SCALES

DEFAULT_EXACT_WINDOW = 32  # EngineConfig.kv_cache_exact_window's default


def exact_window_arg(text: str) -> int | None:
    """--kv-cache-exact-window's value: an int >= 0, or "off" (None)."""
    if text == "off":
        return None
    try:
        window = int(text)
    except ValueError:
        window = -1
    if window < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'off', got {text!r}")
    return window


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype auto|bfloat16|bf16|float16|fp16|fp8|fp8_e4m3, --kv-cache-scales
    calibrated|unit|checkpoint and --kv-cache-exact-window N|off (EngineConfig's kv_cache_dtype,
    kv_cache_scales and kv_cache_exact_window)."""
    parser.add_argument(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default="auto",
        help="KV-cache dtype: auto = the model's; bfloat16 / float16 = a 16-bit cache under a float32 model "
        "(half the bytes decode attention reads); fp8 = float8_e4m3fn, 2x the blocks of a 16-bit cache",
    )
    parser.add_argument(
        "--kv-cache-scales",
        choices=list(KV_CACHE_SCALES),
        default="calibrated",
        help="fp8 KV cache: calibrated = per-head scales and centred keys measured by one prefill at "
        "start-up; unit = scales 1.0; checkpoint = the k/v scales a quantized checkpoint ships "
        "(compressed-tensors kv_cache_scheme: self_attn.k_scale / v_scale), as vLLM uses them",
    )
    parser.add_argument(
        "--kv-cache-exact-window",
        type=exact_window_arg,
        default=DEFAULT_EXACT_WINDOW,
        metavar="N|off",
        help="fp8 KV cache: keep every sequence's first block and its last N positions unrounded "
        f"(float16) and read them from there (default {DEFAULT_EXACT_WINDOW}; 0 = the first block only; "
        "off = none)",
    )


def kv_cache_config_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig's KV-cache keyword arguments from the flags add_kv_cache_arguments defines
    (their defaults where a caller's parser lacks them)."""
    return {
        "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
        "kv_cache_scales": getattr(args, "kv_cache_scales", "calibrated"),
        "kv_cache_exact_window": getattr(args, "kv_cache_exact_window", DEFAULT_EXACT_WINDOW),
    }
