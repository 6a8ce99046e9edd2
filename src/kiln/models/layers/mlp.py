"""The gated MLP of Llama-family models: down(silu(gate(x)) * up(x)), gate and up fused in one GEMM.

Under tensor parallelism gate/up are column-parallel (this rank's intermediate rows) and down_proj is
row-parallel (the matching input columns, summed over the ranks).
"""

from __future__ import annotations

import torch

import kiln.ops
from kiln.models.layers.linear import Linear
from kiln.models.layers.parallel_linear import RowParallelLinear
from kiln.models.layers.tp import TPGroup
from kiln.models.weights import Weight, cat_rows

# activation name -> the fused gated op: "silu" (SwiGLU), "gelu_tanh" (GeGLU with tanh GELU, Gemma)
GATED_ACTIVATIONS = {"silu": kiln.ops.silu_and_mul, "gelu_tanh": kiln.ops.gelu_tanh_and_mul}


class GatedMLP(torch.nn.Module):
    """x [T, hidden] -> [T, hidden]. gate_up rows 0..I-1 are gate, I..2I-1 up (silu_and_mul's layout).

    gate, up [I, hidden] and down [hidden, I]: this rank's slices (I = its intermediate size).
    activation: a key of GATED_ACTIVATIONS ("silu" by default). biases: (gate [I], up [I], down
    [hidden]) or None.
    """

    def __init__(
        self,
        gate: Weight,
        up: Weight,
        down: Weight,
        *,
        device: torch.device,
        dtype: torch.dtype,
        cpu_format: str | None = None,
        tp_group: TPGroup | None = None,
        activation: str = "silu",
        biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        super().__init__()
        if activation not in GATED_ACTIVATIONS:
            known = ", ".join(GATED_ACTIVATIONS)
            raise ValueError(f"GatedMLP: activation {activation!r} is not supported (supported: {known})")
        self.act_and_mul = GATED_ACTIVATIONS[activation]
        gate_up_bias, down_bias = None, None
        if biases is not None:  # transformers' mlp_bias: one per projection
            gate_up_bias, down_bias = torch.cat([biases[0].float(), biases[1].float()]), biases[2].float()
        self.gate_up_proj = Linear(
            cat_rows([gate, up], dtype), gate_up_bias, device=device, dtype=dtype, cpu_format=cpu_format
        )
        self.down_proj = RowParallelLinear(
            down, down_bias, device=device, dtype=dtype, cpu_format=cpu_format, tp_group=tp_group
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # On the CPU with fp16 (or int4/bf16) weights the gate/up output stays in that dtype through
        # silu_and_mul into down_proj: two conversions fewer per layer, and down_proj would round its
        # input to that dtype anyway.
        gate_up = self.gate_up_proj(x, out_dtype=self.gate_up_proj.compute_dtype)
        return self.down_proj(self.act_and_mul(gate_up), out_dtype=x.dtype)
