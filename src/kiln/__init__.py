"""Kiln: GPU kernels (Triton, Pallas), performance tooling and a paged-KV inference engine."""

__version__ = "0.1.0"
