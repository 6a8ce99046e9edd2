"""moe_route as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU); the kernel is
pallas_kernel.py's. The experts are padded to a multiple of 128 lanes, so one block spans every
expert, and the winners go to a lane-dense [block_rows, 128 * ceil(k / 128)] tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kiln.ops.moe.moe_route.pallas_kernel import route_call
from kiln.ops.moe.moe_route.spec import MOE_ROUTE
from kiln.ops.pallas_common import LANES, round_up, row_block, tpu_interpret, tpu_params


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "sigmoid", "interpret"))
def _moe_route_tpu(router_logits, top_k, renormalize, sigmoid, interpret):
    tokens, experts = router_logits.shape
    if router_logits.dtype not in (jnp.float32, jnp.bfloat16):
        router_logits = router_logits.astype(jnp.float32)  # Mosaic's vector types: 32-bit and bf16
    padded_experts = round_up(experts, LANES)
    # live [block_rows, padded_experts] values: logits, exp, keys, columns, alive (~5 float32 rows)
    block_rows = row_block(tokens, padded_experts * 4 * 5, router_logits.dtype, max_rows=256)
    return route_call(
        router_logits, top_k, renormalize, sigmoid, padded_experts=padded_experts,
        padded_k=round_up(top_k, LANES), block_rows=block_rows, compiler_params=tpu_params("parallel"),
        unroll=top_k <= 8, interpret=interpret,
    )  # fmt: skip


def moe_route_pallas_tpu(router_logits, top_k, renormalize=True, scoring="softmax", *, interpret=None):
    """router_logits [num_tokens, num_experts] f32/f16/bf16 -> (topk_weights float32 [num_tokens,
    top_k], topk_ids int32 [num_tokens, top_k]), highest logit first; the Mosaic TPU kernel
    (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    tokens = router_logits.shape[0]
    if tokens == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    return _moe_route_tpu(
        router_logits, top_k=top_k, renormalize=renormalize, sigmoid=scoring == "sigmoid", interpret=interpret
    )


MOE_ROUTE.register_jax("pallas_tpu", moe_route_pallas_tpu)
