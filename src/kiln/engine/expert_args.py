"""The MoE command-line flag `kiln generate` and `kiln serve` share: --expert-format (EngineConfig's
expert_format)."""

from __future__ import annotations

import argparse

from kiln.models.mixtral import EXPERT_FORMATS


def add_expert_arguments(parser: argparse.ArgumentParser) -> None:
    """--expert-format fp8: an MoE model's routed experts stored float8_e4m3fn, scaled per expert."""
    parser.add_argument(
        "--expert-format",
        choices=[name for name in EXPERT_FORMATS if name is not None],
        default=None,
        help="MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE): keep the routed experts in fp8 (e4m3, one scale "
        "per expert): half the bytes of bf16 experts. Default: the model dtype",
    )


def expert_config_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig's expert_format from the flag (None where a caller's parser lacks it)."""
    return {"expert_format": getattr(args, "expert_format", None)}
