"""The CPU-engine command-line flags `kiln generate` and `kiln serve` share: the weight formats and
the compiled decode step (EngineConfig's cpu_format, lm_head_format and compile_cpu_decode)."""

from __future__ import annotations

import argparse

from kiln.ops.gemm.weight_formats import CPU_WEIGHT_FORMATS


def add_cpu_arguments(parser: argparse.ArgumentParser) -> None:
    """--cpu-format F, --lm-head-format F (F in CPU_WEIGHT_FORMATS or "auto"; default: the loader's
    choice, timed on this host by kiln.loaders.cpu_format_probe) and --compile-cpu-decode."""
    formats = ", ".join(CPU_WEIGHT_FORMATS)
    parser.add_argument(
        "--cpu-format",
        choices=[*CPU_WEIGHT_FORMATS, "auto"],
        default=None,
        help=f"CPU linear weights: {formats}, or auto (timed on this host, any checkpoint). Default: "
        "for GGUF files the fastest of fp16 / fp32 / q4_blocks (Q4 blocks kept 4-bit, exact), timed on this "
        "host once and cached. int4_bf16 "
        "with --compile-cpu-decode is the fastest measured, with bf16 activations; int4_w8a8 (an int8 "
        "copy for several rows, x quantized to int8 per row) decodes batches faster at an accuracy cost "
        "(q4_blocks_w8a8: the same for GGUF Q4 weights with q4_blocks' exact kernels up to 7 rows); "
        "q4_blocks_a8 / q8_blocks_a8 (the head follows unless --lm-head-format says otherwise) quantize "
        "a one-row x to Q8_0, or every x row to Q8_K for GGUF K-quant weights, which then keep only the "
        "file's blocks (memory: the file's size), as llama.cpp does: faster decode (a Q4_K_M file: "
        "~1.4x the exact formats single stream, ~1.5x at 16 sequences), not exact",
    )
    parser.add_argument(
        "--lm-head-format",
        choices=[*CPU_WEIGHT_FORMATS, "auto"],
        default=None,
        help="CPU LM-head weights, as --cpu-format (default: timed on this host; with an a8 --cpu-format, "
        "that format). int8_blocks keeps a GGUF Q8_0 head's values: the fastest measured at one row, exact",
    )
    parser.add_argument(
        "--compile-cpu-decode",
        action="store_true",
        help="CPU: decode through a forward compiled per batch size (each size compiles on first use)",
    )


def cpu_config_from_args(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the flags above."""
    return {
        "cpu_format": args.cpu_format,
        "lm_head_format": args.lm_head_format,
        "compile_cpu_decode": args.compile_cpu_decode,
    }
