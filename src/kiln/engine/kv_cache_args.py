"""The KV-cache command-line flags `kiln generate` and `kiln serve` share."""

from __future__ import annotations

import argparse

from kiln.engine.config import KV_CACHE_DTYPES, KV_CACHE_SCALES


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-cache-dtype auto|bfloat16|bf16|float16|fp16|fp8|fp8_e4m3 and --kv-cache-scales
    calibrated|unit (EngineConfig's
    kv_cache_dtype and kv_cache_scales)."""
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
        "start-up; unit = scales 1.0",
    )
