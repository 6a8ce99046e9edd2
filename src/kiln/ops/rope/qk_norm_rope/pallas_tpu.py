"""qk_norm_rope as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for the math.

rotary_embedding's TPU kernel with the norm in front: a program owns a block of tokens, normalizes
each head's [block_tokens, D] tile over D in float32, scales it by the weight, and rotates it as
y * C + (y @ P) * S (P the signed pair-swap permutation, one exact MXU matmul per head; C/S the
per-token cos/sin rows, gathered by XLA in the wrapper). One rounding at the end; q and k alias
their outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, round_up, tpu_interpret, tpu_params
from kiln.ops.rope.qk_norm_rope.spec import QK_NORM_ROPE
from kiln.ops.rope.rotary_embedding.pallas_tpu import pair_tables, rotation_matrix


def _norm_rotate_heads(x_ref, w, o_ref, c, s, p, eps):
    for h in range(x_ref.shape[1]):  # static unroll over heads; each is a [block_tokens, D] tile
        x = x_ref[:, h, :].astype(jnp.float32)
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w
        rotated = jnp.dot(y, p, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
        o_ref[:, h, :] = (y * c + rotated * s).astype(o_ref.dtype)


def _tpu_kernel(c_ref, s_ref, p_ref, qw_ref, kw_ref, q_ref, k_ref, q_out_ref, k_out_ref, *, eps):
    c, s, p = c_ref[...], s_ref[...], p_ref[...]
    _norm_rotate_heads(q_ref, qw_ref[...].astype(jnp.float32), q_out_ref, c, s, p, eps)
    _norm_rotate_heads(k_ref, kw_ref[...].astype(jnp.float32), k_out_ref, c, s, p, eps)


@functools.partial(jax.jit, static_argnames=("eps", "is_neox", "interpret"))
def _qk_norm_rope_tpu(positions, q, k, q_weight, k_weight, cos_sin_cache, eps, is_neox, interpret):
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    c, s = pair_tables(positions, cos_sin_cache, head_dim, is_neox)
    p = jnp.asarray(rotation_matrix(head_dim, cos_sin_cache.shape[-1], is_neox))
    # q/k blocks [block_tokens, heads, D] have their last two dims whole; C/S [block_tokens, D] need
    # a multiple of 8 rows. Zero padding rows normalize to zero.
    row_bytes = (q_heads + k_heads) * head_dim * 4 * 2
    block_tokens = max(8, min(256, (2 << 20) // row_bytes // 8 * 8, round_up(tokens, 8)))
    padded = round_up(tokens, block_tokens)
    table_spec = pl.BlockSpec((block_tokens, head_dim), lambda i: (i, 0))
    weight_spec = pl.BlockSpec((1, head_dim), lambda i: (0, 0))
    q_spec = pl.BlockSpec((block_tokens, q_heads, head_dim), lambda i: (i, 0, 0))
    k_spec = pl.BlockSpec((block_tokens, k_heads, head_dim), lambda i: (i, 0, 0))
    q_out, k_out = pl.pallas_call(
        functools.partial(_tpu_kernel, eps=eps),
        out_shape=(
            jax.ShapeDtypeStruct((padded, q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((padded, k_heads, head_dim), k.dtype),
        ),
        grid=(padded // block_tokens,),
        in_specs=[
            table_spec,
            table_spec,
            pl.BlockSpec((head_dim, head_dim), lambda i: (0, 0)),
            weight_spec,
            weight_spec,
            q_spec,
            k_spec,
        ],
        out_specs=(q_spec, k_spec),
        input_output_aliases={5: 0, 6: 1},
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(
        pad_to(c, 0, padded), pad_to(s, 0, padded), p, q_weight.reshape(1, head_dim),
        k_weight.reshape(1, head_dim), pad_to(q, 0, padded), pad_to(k, 0, padded),
    )  # fmt: skip
    return q_out[:tokens], k_out[:tokens]


def qk_norm_rope_pallas_tpu(
    positions, q, k, q_weight, k_weight, cos_sin_cache, eps: float = 1e-6, is_neox: bool = True,
    *, interpret=None,
):  # fmt: skip
    """Returns the normalized and rotated (q, k); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return _qk_norm_rope_tpu(
        positions, q, k, q_weight, k_weight, cos_sin_cache, eps=float(eps), is_neox=bool(is_neox),
        interpret=interpret,
    )  # fmt: skip


QK_NORM_ROPE.register_jax("pallas_tpu", qk_norm_rope_pallas_tpu)
