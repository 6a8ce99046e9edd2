"""Linear layers: y = x @ W^T (+ b), with W in the checkpoint's [out_features, in_features] layout.

One module, several weight formats, chosen once at load time for the device:
  - "gguf":  CUDA + GGUF Q4_0/Q4_1/Q8_0 blocks kept as stored -> `kiln.ops.gguf_linear`;
  - "int4":  CPU + GGUF Q4_0/Q4_1 -> PyTorch's weight-packed int4 CPU matmul, group size 32. A Q4_1
             block w = d*q + m (q in 0..15) is torch's (q - 8) * scale + zero with scale = d,
             zero = m + 8d (Q4_0: m = -8d, so zero = 0), so the packed weights are the GGUF ones exactly;
             activations go through the kernel in bfloat16 (its fast path);
  - "dense": a float matrix in `weight_dtype`. On CUDA -> `kiln.ops.linear`. On the CPU the weight is
             reordered once for oneDNN (kiln.models.layers.onednn_linear; 3-4x faster than F.linear's
             MKL sgemm at 4-64 rows here, same float32 arithmetic): "fp32" keeps only that packed copy;
             "fp16" keeps the fp16 matrix for one-row inputs (PyTorch's fp16 GEMV reads half the
             bytes) and a packed float32 copy of the same fp16-rounded values for several rows
             (PyTorch's CPU fp16 GEMM is slow beyond one row); "bf16" packs the bf16 matrix.
Fused projections (QKV, gate/up) are one Linear over row-stacked weights (`kiln.models.weights.cat_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kiln.ops
from kiln.models.layers import onednn_linear
from kiln.models.weights import GGUFWeight, Weight

CPU_WEIGHT_FORMATS = ("int4", "fp16", "bf16", "fp32")
_FORMAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def _int4_packable(weight: Weight) -> bool:
    # torch's CPU packing needs out_features % 16 == 0; GGUF rows are whole 32-blocks already.
    return isinstance(weight, GGUFWeight) and weight.qtype in ("Q4_0", "Q4_1") and weight.shape[0] % 16 == 0


class Linear(torch.nn.Module):
    """y [M, out_features] = x [M, in_features] @ W^T + bias, in x's dtype.

    weight: float tensor [out, in] or GGUFWeight; bias: [out] or None.
    dtype: the activation dtype; cpu_format: how CPU weights are kept ("int4" applies to GGUF Q4 weights
    only, others fall back to dense "fp32"/"fp16"/"bf16"); None = the model dtype for dense weights.
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
        self.bias = None if bias is None else bias.to(device=device, dtype=dtype)
        self.format = "dense"
        self.weight: torch.Tensor | None = None  # plain [out, in] matrix (None when only packed)
        self.onednn_weight: torch.Tensor | None = None  # oneDNN-packed CPU weight (see onednn_linear)
        self.rows_weight: torch.Tensor | None = None  # fp32 copy of fp16 CPU weights without oneDNN
        if device.type == "cuda" and isinstance(weight, GGUFWeight) and hasattr(kiln.ops, "gguf_linear"):
            self.format = "gguf"
            self.qtype = weight.qtype
            self.qweight = weight.data.to(device)
        elif device.type == "cpu" and cpu_format == "int4" and _int4_packable(weight):
            self.format = "int4"
            self._pack_int4(weight)
        else:
            weight_dtype = (
                dtype if device.type != "cpu" or cpu_format in (None, "int4") else _FORMAT_DTYPES[cpu_format]
            )
            self.weight_dtype = weight_dtype
            if isinstance(weight, GGUFWeight):
                weight = weight.dequantize(torch.float32)
            weight = weight.to(device=device, dtype=weight_dtype).contiguous()
            if self.bias is not None:
                self.bias = self.bias.to(weight_dtype)
            if device.type == "cpu":
                self._pack_dense(weight)
            else:
                self.weight = weight

    def _pack_dense(self, weight: torch.Tensor) -> None:
        if weight.dtype == torch.float16:
            self.weight = weight  # one-row inputs: the fp16 GEMV
            self.onednn_weight = onednn_linear.pack(weight.float())
            if self.onednn_weight is None:
                self.rows_weight = weight.float()
        else:
            self.onednn_weight = onednn_linear.pack(weight)
            if self.onednn_weight is None:
                self.weight = weight

    def _bias_as(self, dtype: torch.dtype) -> torch.Tensor | None:
        # read from self.bias on every call: RowParallelLinear clears it on all but one rank
        bias = self.bias
        return bias if bias is None or bias.dtype == dtype else bias.to(dtype)

    def _pack_int4(self, weight: GGUFWeight) -> None:
        scale, minimum = weight.scales_and_mins()  # [out, in / 32]
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.nibbles(), 1)
        zero = minimum + 8.0 * scale
        # [in / 32, out, 2] in the activation dtype the kernel runs in (bfloat16: its fast path)
        self.scales_and_zeros = (
            torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        )

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The activation dtype the kernel consumes (None: whatever x is)."""
        if self.format == "int4":
            return torch.bfloat16
        return self.weight_dtype if self.format == "dense" else None

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] in `out_dtype` (default: x's dtype). Passing the
        compute_dtype as out_dtype (and feeding such outputs back in) skips conversions between
        layers that run in the same reduced precision, e.g. gate/up -> silu_and_mul -> down."""
        out_dtype = out_dtype or x.dtype
        if self.format == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16), self.packed, 32, self.scales_and_zeros
            )
            if self.bias is not None:
                y = y.float().add_(self.bias)
            return y.to(out_dtype)
        if self.format == "gguf":
            return kiln.ops.gguf_linear(x, self.qweight, self.qtype, self.bias).to(out_dtype)
        packed = self.onednn_weight
        if packed is not None and (self.weight is None or x.shape[0] > 1):
            return onednn_linear.linear(x.to(packed.dtype), packed, self._bias_as(packed.dtype)).to(out_dtype)
        if self.rows_weight is not None and x.shape[0] > 1:
            return F.linear(x.float(), self.rows_weight, self._bias_as(torch.float32)).to(out_dtype)
        if self.weight.dtype != x.dtype:
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(out_dtype)
        if x.is_cuda and hasattr(kiln.ops, "linear"):
            return kiln.ops.linear(x, self.weight, self.bias).to(out_dtype)
        return F.linear(x, self.weight, self.bias).to(out_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format}"
