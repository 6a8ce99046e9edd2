"""Every weight format Kiln's GEMMs take, by name: quantize a float [N, K] weight, dequantize it back,
and report the error per named weight (the engine calls `quantization_report` layer by layer).

Formats: "int4_g32", "int4_g64", "int4_g128" (int4_linear), "fp8" (fp8_linear, per channel),
"int8" (int8_linear, per channel), "Q4_0", "Q4_1", "Q8_0" (gguf_linear; K a multiple of 32).
`quantize_weight` / `dequantize_weight` / `roundtrip` also take the other GGUF block types of
gguf_linear ("Q5_0"; "Q4_K", "Q5_K", "Q6_K" with K a multiple of 256) and "sparse24" (sparse24_linear:
2:4 magnitude pruning, kept halves + positions; K a multiple of 4), which FORMATS leaves out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from kiln.quant import gguf_blocks, int4, scaled, sparse24
from kiln.quant.metrics import error_metrics

FORMATS = ("int4_g32", "int4_g64", "int4_g128", "fp8", "int8", "Q4_0", "Q4_1", "Q8_0")


def quantize_weight(weight: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """weight [N, K] -> the tensors the format's GEMM takes (names as that op's arguments)."""
    if fmt.startswith("int4_g"):
        qweight, scales, zeros = int4.quantize_int4(weight, int(fmt[len("int4_g") :]))
        return {"qweight": qweight, "scales": scales, "zeros": zeros}
    if fmt == "fp8":
        w_fp8, w_scale = scaled.quantize_fp8_per_channel(weight)
        return {"w_fp8": w_fp8, "w_scale": w_scale}
    if fmt == "int8":
        w_int8, w_scale = scaled.quantize_int8_per_channel(weight)
        return {"w_int8": w_int8, "w_scale": w_scale}
    if fmt in gguf_blocks.KERNEL_QTYPES:
        return {"qweight": gguf_blocks.quantize_blocks(weight, fmt)}
    if fmt == "sparse24":
        values, meta = sparse24.compress_24(sparse24.prune_24(weight))
        return {"values": values, "meta": meta}
    raise ValueError(f"quantize_weight: unknown format {fmt!r}, expected one of {FORMATS}")


def dequantize_weight(quantized: Mapping[str, torch.Tensor], fmt: str, K: int) -> torch.Tensor:
    """The float32 [N, K] weight that a format's tensors stand for."""
    if fmt.startswith("int4_g"):
        group_size = int(fmt[len("int4_g") :])
        return int4.dequantize_int4(
            quantized["qweight"], quantized["scales"], quantized["zeros"], group_size, K
        )
    if fmt == "fp8":
        return scaled.dequantize_per_channel(quantized["w_fp8"], quantized["w_scale"])
    if fmt == "int8":
        return scaled.dequantize_per_channel(quantized["w_int8"], quantized["w_scale"])
    if fmt in gguf_blocks.KERNEL_QTYPES:
        return gguf_blocks.dequantize_blocks(quantized["qweight"], fmt)
    if fmt == "sparse24":
        return sparse24.decompress_24(quantized["values"], quantized["meta"], torch.float32)
    raise ValueError(f"dequantize_weight: unknown format {fmt!r}, expected one of {FORMATS}")


def roundtrip(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """quantize then dequantize: the float32 weight a quantized model actually uses."""
    return dequantize_weight(quantize_weight(weight, fmt), fmt, weight.shape[1])


def quantization_report(
    weights: Mapping[str, torch.Tensor], formats: Iterable[str] = FORMATS
) -> dict[str, dict[str, dict[str, float]]]:
    """{weight name: {format: {"snr_db", "cosine", "max_abs_error"}}} for 2-D weights. GGUF formats
        are skipped for a weight whose K is not a multiple of their block (32; 256 for the K-quants), sparse24
    where K is not a multiple of 4."""
    report: dict[str, dict[str, dict[str, float]]] = {}
    for name, weight in weights.items():
        if weight.dim() != 2:
            raise ValueError(
                f"quantization_report: weight {name!r} has shape {tuple(weight.shape)}, expected 2-D"
            )
        row = {}
        for fmt in formats:
            if fmt in gguf_blocks.KERNEL_QTYPES and weight.shape[1] % gguf_blocks.block_weights(fmt):
                continue
            if fmt == "sparse24" and weight.shape[1] % sparse24.GROUP:
                continue
            row[fmt] = error_metrics(weight.float(), roundtrip(weight, fmt))
        report[name] = row
    return report
