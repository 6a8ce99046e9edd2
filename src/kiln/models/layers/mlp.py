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
        # On the CPU with fp16 (or int4/bf16) weights the gate/up output stays in that dtype through
        # silu_and_mul into down_proj: two conversions fewer per layer, and down_proj would round its
        # input to that dtype anyway.
        gate_up = self.gate_up_proj(x, out_dtype=self.gate_up_proj.compute_dtype)
        return self.down_proj(self._silu_and_mul(gate_up), out_dtype=x.dtype)
