"""The gated MLP of Llama-family models: down(silu(gate(x)) * up(x)), gate and up fused in one GEMM."""

from __future__ import annotations

import torch

from kiln.models.layers.linear import Linear
from kiln.models.layers.torch_ops import op
from kiln.models.weights import Weight, cat_rows


class GatedMLP(torch.nn.Module):
    """x [T, hidden] -> [T, hidden]. gate_up rows 0..I-1 are gate, I..2I-1 up (silu_and_mul's layout)."""

    def __init__(self, gate: Weight, up: Weight, down: Weight, *, device, dtype, cpu_format=None):
        super().__init__()
        self.gate_up_proj = Linear(
            cat_rows([gate, up], dtype), None, device=device, dtype=dtype, cpu_format=cpu_format
        )
        self.down_proj = Linear(down, None, device=device, dtype=dtype, cpu_format=cpu_format)
        self._silu_and_mul = op("silu_and_mul", device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._silu_and_mul(self.gate_up_proj(x)))
