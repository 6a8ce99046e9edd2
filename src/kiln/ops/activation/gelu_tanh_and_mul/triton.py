"""gelu_tanh_and_mul in Triton: the gated kernel of ../gated_triton.py with ACTIVATION="gelu_tanh"."""

from __future__ import annotations

from kiln.ops.activation.gated_triton import gated_configs, launch_gated
from kiln.ops.activation.gelu_tanh_and_mul.spec import GELU_TANH_AND_MUL
from kiln.ops.registry import Implementation, triton_available


def gelu_tanh_and_mul_triton(x, config: dict | None = None):
    return launch_gated(x, "gelu_tanh", "gelu_tanh_and_mul", config)


GELU_TANH_AND_MUL.register(
    Implementation("triton", gelu_tanh_and_mul_triton, triton_available, configs=gated_configs)
)
