"""Weight quantization: quantizers and codecs for every format Kiln's GEMMs take (int4 group-wise,
FP8/INT8 per channel, GGUF blocks (Q4_0/Q4_1/Q5_0/Q8_0, Q4_K/Q5_K/Q6_K) and `GGUFWeight`, a matrix
of them, 2:4 structured sparsity: kiln.quant.sparse24) and error metrics (SNR dB, cosine, max abs error)."""

from kiln.quant.formats import FORMATS, dequantize_weight, quantization_report, quantize_weight, roundtrip
from kiln.quant.gguf_blocks import GGUFWeight, dequantize_any, dequantize_blocks, quantize_blocks
from kiln.quant.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from kiln.quant.metrics import cosine_similarity, error_metrics, max_abs_error, snr_db
from kiln.quant.scaled import dequantize_per_channel, quantize_fp8_per_channel, quantize_int8_per_channel

__all__ = [
    "FORMATS",
    "GGUFWeight",
    "cosine_similarity",
    "dequantize_any",
    "dequantize_blocks",
    "dequantize_int4",
    "dequantize_per_channel",
    "dequantize_weight",
    "error_metrics",
    "max_abs_error",
    "pack_int4",
    "quantization_report",
    "quantize_blocks",
    "quantize_fp8_per_channel",
    "quantize_int4",
    "quantize_int8_per_channel",
    "quantize_weight",
    "roundtrip",
    "snr_db",
    "unpack_int4",
]
