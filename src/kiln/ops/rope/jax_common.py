"""What the rope family's Pallas TPU kernels share (rotary_embedding and qk_norm_rope): the rotation

    x' = x * C + rotate(x) * S, with C/S the per-token cos/sin spread over the pair members (C = 1,
    S = 0 on the dims past rotary_dim) and rotate(x) the signed pair swap (-x_b for a, x_a for b),

written as x @ P with P a [D, D] signed permutation: one MXU matmul per head instead of lane shuffles
at unaligned offsets, exact because each output takes one +-1 term. The per-token C/S rows are
gathered by XLA in the wrapper (T x D floats, small next to q and k). qk_norm_rope RMS-normalizes
each head over D (float32, times its weight) before rotating. One rounding at the end; q and k
alias their outputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, round_up, tpu_params


def pair_tables(positions, cos_sin_cache, head_dim: int, is_neox: bool):
    """(C, S) float32 [T, head_dim]: cos/sin of each dim's pair for each token (1/0 past rotary_dim)."""
    rotary_dim = cos_sin_cache.shape[-1]
    cos_sin = cos_sin_cache[positions].astype(jnp.float32)
    cos, sin = cos_sin[:, : rotary_dim // 2], cos_sin[:, rotary_dim // 2 :]
    if is_neox:
        c, s = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
    else:
        c, s = jnp.repeat(cos, 2, axis=-1), jnp.repeat(sin, 2, axis=-1)
    tokens, rest = positions.shape[0], head_dim - rotary_dim
    c = jnp.concatenate([c, jnp.ones((tokens, rest), jnp.float32)], axis=-1)
    s = jnp.concatenate([s, jnp.zeros((tokens, rest), jnp.float32)], axis=-1)
    return c, s


def rotation_matrix(head_dim: int, rotary_dim: int, is_neox: bool) -> np.ndarray:
    """P [head_dim, head_dim] float32 with (x @ P) = rotate(x): for pair (a, b), out_a = -x_b, out_b = x_a."""
    p = np.zeros((head_dim, head_dim), np.float32)
    half = rotary_dim // 2
    for i in range(half):
        a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
        p[b, a] = -1.0
        p[a, b] = 1.0
    return p


def _rotate_heads(x_ref, o_ref, c, s, p, weight, eps):
    """Every head of a [block_tokens, heads, D] block, RMS-normalized first when `weight` is set."""
    for h in range(x_ref.shape[1]):  # static unroll over heads; each is a [block_tokens, D] tile
        x = x_ref[:, h, :].astype(jnp.float32)
        if weight is not None:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight
        rotated = jnp.dot(x, p, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
        o_ref[:, h, :] = (x * c + rotated * s).astype(o_ref.dtype)


def _tpu_kernel(c_ref, s_ref, p_ref, *refs, eps):
    if eps is None:
        q_ref, k_ref, q_out_ref, k_out_ref = refs
        q_weight = k_weight = None
    else:
        qw_ref, kw_ref, q_ref, k_ref, q_out_ref, k_out_ref = refs
        q_weight, k_weight = qw_ref[...].astype(jnp.float32), kw_ref[...].astype(jnp.float32)
    c, s, p = c_ref[...], s_ref[...], p_ref[...]
    _rotate_heads(q_ref, q_out_ref, c, s, p, q_weight, eps)
    _rotate_heads(k_ref, k_out_ref, c, s, p, k_weight, eps)


@functools.partial(jax.jit, static_argnames=("eps", "is_neox", "interpret"))
def rope_tpu(positions, q, k, cos_sin_cache, q_weight, k_weight, eps, is_neox, interpret):
    """positions int [T], q [T, Hq, D], k [T, Hk, D], cos_sin_cache [P, rotary_dim] -> the rotated
    (q, k) in their dtypes; with eps set, each head is first RMS-normalized and scaled by q_weight /
    k_weight [D] (eps None: the weights are not read). The Mosaic TPU kernel (T > 0)."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    c, s = pair_tables(positions, cos_sin_cache, head_dim, is_neox)
    p = jnp.asarray(rotation_matrix(head_dim, cos_sin_cache.shape[-1], is_neox))
    # q/k blocks [block_tokens, heads, D] have their last two dims whole, so any block_tokens is legal
    # for them; the C/S blocks [block_tokens, D] need a multiple of 8 rows. Zero padding rows
    # normalize to zero.
    row_bytes = (q_heads + k_heads) * head_dim * 4 * 2
    block_tokens = max(8, min(256, (2 << 20) // row_bytes // 8 * 8, round_up(tokens, 8)))
    padded = round_up(tokens, block_tokens)
    table_spec = pl.BlockSpec((block_tokens, head_dim), lambda i: (i, 0))
    q_spec = pl.BlockSpec((block_tokens, q_heads, head_dim), lambda i: (i, 0, 0))
    k_spec = pl.BlockSpec((block_tokens, k_heads, head_dim), lambda i: (i, 0, 0))
    in_specs = [table_spec, table_spec, pl.BlockSpec((head_dim, head_dim), lambda i: (0, 0))]
    operands = [pad_to(c, 0, padded), pad_to(s, 0, padded), p]
    if eps is not None:
        in_specs += [pl.BlockSpec((1, head_dim), lambda i: (0, 0))] * 2
        operands += [q_weight.reshape(1, head_dim), k_weight.reshape(1, head_dim)]
    q_out, k_out = pl.pallas_call(
        functools.partial(_tpu_kernel, eps=eps),
        out_shape=(
            jax.ShapeDtypeStruct((padded, q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((padded, k_heads, head_dim), k.dtype),
        ),
        grid=(padded // block_tokens,),
        in_specs=[*in_specs, q_spec, k_spec],
        out_specs=(q_spec, k_spec),
        input_output_aliases={len(operands): 0, len(operands) + 1: 1},
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(*operands, pad_to(q, 0, padded), pad_to(k, 0, padded))
    return q_out[:tokens], k_out[:tokens]
