"""w8a16_linear: spec in spec.py, one file per backend beside it (the JAX kernels are linear's with a
per-channel scale epilogue; no Triton kernel yet: CUDA tensors take the reference)."""

from kiln.ops.gemm.w8a16_linear import cpu  # noqa: F401  (registers the implementation)
from kiln.ops.gemm.w8a16_linear.spec import W8A16_LINEAR, quantize_weight_int8, w8a16_linear

__all__ = ["W8A16_LINEAR", "quantize_weight_int8", "w8a16_linear"]
