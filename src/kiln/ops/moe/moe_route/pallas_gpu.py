"""moe_route as a Pallas Triton (GPU) kernel (the Pallas interpreter off a GPU); the kernel is
pallas_kernel.py's. Triton's blocks are powers of two: the experts are padded to one with -inf, the
k winners go to a [block_rows, next_pow2(k)] tile, and the k rounds are a loop (the Triton lowering
refuses an unrolled one).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.moe.moe_route.pallas_kernel import route_call
from kiln.ops.moe.moe_route.spec import MOE_ROUTE
from kiln.ops.pallas_common import gpu_interpret

# elements of one program's [block_rows, padded_experts] tile: a few such float32 / int32 tiles live
# at once (logits, keys, alive flags), which 4 warps hold in registers up to about this size
_TILE_ELEMENTS = 4096


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "sigmoid", "interpret"))
def _moe_route_gpu(router_logits, top_k, renormalize, sigmoid, interpret):
    from jax.experimental.pallas import triton as plgpu

    tokens, experts = router_logits.shape
    padded_experts = pl.next_power_of_2(experts)
    block_rows = max(1, min(64, _TILE_ELEMENTS // padded_experts, pl.next_power_of_2(tokens)))
    return route_call(
        router_logits, top_k, renormalize, sigmoid, padded_experts=padded_experts,
        padded_k=pl.next_power_of_2(top_k), block_rows=block_rows,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), unroll=False, interpret=interpret,
    )  # fmt: skip


def moe_route_pallas_gpu(router_logits, top_k, renormalize=True, scoring="softmax", *, interpret=None):
    """router_logits [num_tokens, num_experts] f32/f16/bf16 -> (topk_weights float32 [num_tokens,
    top_k], topk_ids int32 [num_tokens, top_k]), highest logit first; the Pallas Triton kernel
    (interpreted off-GPU)."""
    interpret = gpu_interpret() if interpret is None else interpret
    if router_logits.shape[0] == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    return _moe_route_gpu(
        router_logits, top_k=top_k, renormalize=renormalize, sigmoid=scoring == "sigmoid", interpret=interpret
    )


MOE_ROUTE.register_jax("pallas_gpu", moe_route_pallas_gpu)
