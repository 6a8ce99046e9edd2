"""Floors, tables, JSON and the command line of `kiln verify --quant-model` (the measurement itself is
kiln.verify.quant_model): exit status 1 when a floor is violated or a metric is NaN."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from kiln.environment import environment
from kiln.text_table import aligned_table
from kiln.verify.quant_model import (
    FORMAT_NAMES,
    Checkpoint,
    FormatReport,
    quant_checkpoint_report,
    quant_model_report,
)


def check_floors(
    reports: list[FormatReport],
    min_cosine: float | None = None,
    min_top1: float | None = None,
    min_weight_snr: float | None = None,
) -> list[str]:
    """One line per violated floor (final-logits mean cosine, top-1 agreement, worst weight SNR);
    a NaN anywhere is always a violation."""
    failures = []
    for r in reports:
        values = [r.logits_cosine, r.logits_snr_db, r.top1_agreement, r.perplexity]
        values += [v for m in list(r.weights.values()) + r.layers for v in m.values()]
        if any(v != v for v in values):
            failures.append(f"{r.format}: NaN in the metrics")
        if min_cosine is not None and not r.logits_cosine >= min_cosine:
            failures.append(
                f"{r.format}: final-logits cosine {r.logits_cosine:.5f} < --min-cosine {min_cosine}"
            )
        if min_top1 is not None and not r.top1_agreement >= min_top1:
            failures.append(f"{r.format}: top-1 agreement {r.top1_agreement:.3f} < --min-top1 {min_top1}")
        worst = r.weight_stat("snr_db", "min")
        if min_weight_snr is not None and not worst >= min_weight_snr:
            failures.append(
                f"{r.format}: worst weight SNR {worst:.2f} dB < --min-weight-snr {min_weight_snr}"
            )
    return failures


def format_tables(reports: list[FormatReport], per_tensor: bool = False) -> str:
    """The summary per format, the per-layer hidden-state error per format, and (per_tensor) every
    weight's metrics: plain-text tables like `kiln verify`'s."""
    parts = [
        aligned_table(
            ("format", "weights", "worst SNR dB", "mean SNR dB", "worst cos", "max abs err",
             "logits cos", "worst pos cos", "top-1", "perplexity"),
            [
                (r.format, str(len(r.weights)), f"{r.weight_stat('snr_db', 'min'):.2f}",
                 f"{r.weight_stat('snr_db', 'mean'):.2f}", f"{r.weight_stat('cosine', 'min'):.6f}",
                 f"{r.weight_stat('max_abs_error', 'max'):.3e}", f"{r.logits_cosine:.5f}",
                 f"{r.logits_min_cosine:.5f}", f"{r.top1_agreement:.3f}", f"{r.perplexity:.3f}")
                for r in reports
            ],
        )
    ]  # fmt: skip
    for r in reports:
        rows = [
            (str(i), f"{m['snr_db']:.2f}", f"{m['cosine']:.6f}", f"{m['min_token_cosine']:.6f}",
             f"{m['max_abs_error']:.3e}")
            for i, m in enumerate(r.layers)
        ]  # fmt: skip
        parts.append(f"hidden state after each layer, {r.format} vs float32:\n" + aligned_table(
            ("layer", "SNR dB", "cosine", "worst token cos", "max abs err"), rows))  # fmt: skip
    if per_tensor:
        for r in reports:
            rows = [
                (name, f"{m['snr_db']:.2f}", f"{m['cosine']:.6f}", f"{m['max_abs_error']:.3e}")
                for name, m in r.weights.items()
            ]
            parts.append(
                f"weights, {r.format}:\n" + aligned_table(("tensor", "SNR dB", "cosine", "max abs err"), rows)
            )
    return "\n\n".join(parts)


def to_json(ckpt: Checkpoint, reports: list[FormatReport], floors: dict, failures: list[str]) -> dict:
    """The JSON payload of `kiln verify --quant-model` (inf SNR, for an exact weight, written as null)."""

    def clean(value):
        if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    formats = []
    for r in reports:
        summary = {
            f"{how}_weight_{metric}": r.weight_stat(metric, how)
            for metric in ("snr_db", "cosine", "max_abs_error")
            for how in ("min", "mean")
        }
        formats.append(
            {
                "format": r.format,
                **summary,
                "worst_weight_max_abs_error": r.weight_stat("max_abs_error", "max"),
                "logits_cosine": r.logits_cosine,
                "logits_min_cosine": r.logits_min_cosine,
                "logits_snr_db": r.logits_snr_db,
                "top1_agreement": r.top1_agreement,
                "perplexity": r.perplexity,
                "layers": r.layers,
                "weights": r.weights,
            }
        )
    payload = {
        "kind": "kiln-verify-quant-model",
        "version": 1,
        "model": ckpt.source,
        "prompt_tokens": len(ckpt.token_ids),
        "perplexity_tokens": len(ckpt.perplexity_ids),
        "float_perplexity": ckpt.float_perplexity,
        "num_layers": len(reports[0].layers) if reports else 0,
        "torch": torch.__version__,
        "environment": environment(),
        "floors": floors,
        "failures": failures,
        "passed": not failures,
        "formats": formats,
    }
    return clean(payload)


def run_cli(args) -> int:
    """`kiln verify --quant-model [PATH] (--format F ... | --against QUANT_DIR ...) [--layers N]
    [--min-cosine C] [--min-top1 A] [--min-weight-snr DB] [--per-tensor] [--json PATH]`: exit 1 when a
    floor fails."""
    if getattr(args, "against", None):
        if args.format:
            print("kiln verify: --format is ignored with --against (the checkpoint's format is measured)")
        try:
            ckpt, reports = quant_checkpoint_report(
                args.quant_model or None, args.against, num_layers=args.layers
            )
        except ValueError as exc:  # not a checkpoint, another model's, or nothing quantized in it
            print(f"kiln verify: {exc}", file=sys.stderr)
            return 2
    else:
        formats = args.format or ["int4-g128"]
        if "all" in formats:
            formats = list(FORMAT_NAMES)
        ckpt, reports = quant_model_report(args.quant_model or None, formats, num_layers=args.layers)
    floors = {"min_cosine": args.min_cosine, "min_top1": args.min_top1, "min_weight_snr": args.min_weight_snr}
    failures = check_floors(reports, **floors)
    print(f"model: {ckpt.source} ({len(reports[0].layers)} layers, prompt of {len(ckpt.token_ids)} tokens)")
    print(
        f"float32 perplexity on the shipped text ({len(ckpt.perplexity_ids)} tokens): "
        f"{ckpt.float_perplexity:.3f}"
    )
    print(format_tables(reports, per_tensor=args.per_tensor))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        payload = to_json(ckpt, reports, floors, failures)
        if getattr(args, "against", None):
            payload["against"] = list(args.against)  # the quantized checkpoints, in "formats" order
        Path(args.json).write_text(json.dumps(payload, indent=2))
    for failure in failures:
        print(f"FAILED {failure}")
    print(f"\n{len(reports)} format(s): {'FAIL' if failures else 'PASS'}")
    return 1 if failures else 0


def add_arguments(parser) -> None:
    """The --quant-model options of `kiln verify` (without --quant-model, op verification runs)."""
    q = parser.add_argument_group("quantization error through a model (--quant-model)")
    q.add_argument(
        "--quant-model",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="report a format's error per weight, per layer and on the logits "
        "(PATH: .gguf or HF dir; default the embedded SmolLM2)",
    )
    q.add_argument(
        "--format", action="append", help=f"{'|'.join(FORMAT_NAMES)}|all (repeatable; default int4-g128)"
    )
    q.add_argument(
        "--against",
        action="append",
        default=None,
        metavar="QUANT_DIR",
        help="measure this quantized HF checkpoint (e.g. from `kiln quantize`) against the --quant-model "
        "PATH it was made from, instead of fake-quantizing with --format (repeatable)",
    )
    q.add_argument("--layers", type=int, default=None, help="run only the first N decoder layers (faster)")
    q.add_argument(
        "--min-cosine",
        type=float,
        default=0.99,
        help="floor on the final-logits mean per-position cosine (exit 1 below; default 0.99)",
    )
    q.add_argument("--min-top1", type=float, default=None, help="floor on the top-1 agreement (exit 1 below)")
    q.add_argument(
        "--min-weight-snr",
        type=float,
        default=None,
        help="floor on the worst weight SNR in dB (exit 1 below)",
    )
    q.add_argument("--per-tensor", action="store_true", help="also print every weight's metrics")  # fmt: skip
