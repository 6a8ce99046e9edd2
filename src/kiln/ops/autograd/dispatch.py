"""Which backward runs: the same rule as the forward ops' dispatch (kiln.ops.registry).

KILN_BACKEND=triton forces the Triton backward (the Triton interpreter on a CPU), any other forced
backend ("cpu", "reference") the plain-torch one; otherwise CUDA tensors take Triton, the rest torch.
"""

from __future__ import annotations

import torch

from kiln.ops.registry import env_backend, triton_available


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the backward of an op on `tensor` should run its Triton kernel."""
    backend = env_backend()
    if backend is not None:
        return backend.startswith("triton") and triton_available(tensor.device)
    return tensor.device.type == "cuda" and triton_available(tensor.device)
