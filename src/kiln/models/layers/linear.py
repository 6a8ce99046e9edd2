"""Linear layers: y = x @ W^T (+ b), with W in the checkpoint's [out_features, in_features] layout.

The weight is prepared once, at load, for the device (`kiln.ops.gemm.weight_formats`: GGUF blocks on
CUDA, int4 / oneDNN-packed fp32 / fp16 GEMV + packed copy / bf16 on the CPU, a plain matrix otherwise)
and every forward is one call of the public op `kiln.ops.prepared_linear`, the path `kiln verify` and
`kiln bench` check. Fused projections (QKV, gate/up) are one Linear over row-stacked weights
(`kiln.models.weights.cat_rows`).
"""

from __future__ import annotations

import torch

import kiln.ops
from kiln.models.weights import Weight
from kiln.ops.gemm.weight_formats import CPU_WEIGHT_FORMATS, prepare_linear_weight

__all__ = ["CPU_WEIGHT_FORMATS", "Linear"]


class Linear(torch.nn.Module):
    """y [M, out_features] = x [M, in_features] @ W^T + bias, in x's dtype.

    weight: float tensor [out, in], GGUFWeight, or a quantized checkpoint weight (ScaledWeight,
    BlockFP8Weight, Int4Weight: kiln.quant.linear_weights); bias: [out] or None.
    dtype: the activation dtype; cpu_format: how CPU weights are kept (CPU_WEIGHT_FORMATS: "int4"
    applies to GGUF Q4 weights only, others fall back to dense "fp32"/"fp16"/"bf16"); None = the model
    dtype for dense weights.
    """

    def __init__(
        self,
        weight: Weight,
        bias: torch.Tensor | None,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_format: str | None = None,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.prepared = prepare_linear_weight(weight, device=device, dtype=dtype, cpu_format=cpu_format)
        # read on every call; in the activation dtype, then the one the layout adds it in
        if bias is not None:
            bias = bias.to(device=device, dtype=dtype).to(self.prepared.bias_dtype)
        self.bias = bias

    @property
    def format(self) -> str:
        """How the weight is stored: "gguf", "int4", "fp8", "int8", "w4a16", "fp8_block" or "dense"
        (PreparedLinearWeight.kind)."""
        return self.prepared.kind

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The activation dtype the kernel consumes (None: whatever x is)."""
        return self.prepared.compute_dtype

    @property
    def weight(self) -> torch.Tensor | None:
        """The plain [out, in] matrix when the layout keeps one, else None (packed weights only)."""
        return self.prepared.matrix

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in `out_dtype` (default: x's dtype). Passing the
        compute_dtype as out_dtype (and feeding such outputs back in) skips conversions between
        layers that run in the same reduced precision, e.g. gate/up -> silu_and_mul -> down."""
        prepared = self.prepared
        return kiln.ops.prepared_linear(x, prepared.layout, prepared.tensors, self.bias, out_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format}"
