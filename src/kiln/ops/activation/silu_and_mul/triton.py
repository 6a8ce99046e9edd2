"""silu_and_mul in Triton: the gated kernel of ../gated_triton.py with ACTIVATION="silu"."""

from __future__ import annotations

from kiln.ops.activation.gated_triton import gated_configs, launch_gated
from kiln.ops.activation.silu_and_mul.spec import SILU_AND_MUL
from kiln.ops.registry import Implementation, triton_available


def silu_and_mul_triton(x, config: dict | None = None):
    return launch_gated(x, "silu", "silu_and_mul", config)


SILU_AND_MUL.register(Implementation("triton", silu_and_mul_triton, triton_available, configs=gated_configs))
