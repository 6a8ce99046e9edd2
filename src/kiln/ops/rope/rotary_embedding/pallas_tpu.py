"""rotary_embedding as a Pallas Mosaic TPU kernel (the TPU interpreter off a TPU). See xla.py for
the layouts and the pair conventions.

    x' = x * C + rotate(x) * S, with C/S the per-token cos/sin spread over the pair members (C = 1,
    S = 0 on the dims past rotary_dim) and rotate(x) the signed pair swap (-x_b for a, x_a for b).

The TPU kernel writes rotate(x) as x @ P with P a [D, D] signed permutation: one MXU matmul per
head instead of lane shuffles at unaligned offsets, exact because each output takes one +-1 term.
The per-token C/S rows are gathered by XLA in the wrapper (T x D floats, small next to q and k).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import pad_to, round_up, tpu_interpret, tpu_params
from kiln.ops.rope.rotary_embedding.spec import ROTARY_EMBEDDING


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


def _rotate_heads(x_ref, o_ref, c, s, p):
    for h in range(x_ref.shape[1]):  # static unroll over heads; each is a [block_tokens, D] tile
        x = x_ref[:, h, :].astype(jnp.float32)
        rotated = jnp.dot(x, p, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
        o_ref[:, h, :] = (x * c + rotated * s).astype(o_ref.dtype)


def _tpu_kernel(c_ref, s_ref, p_ref, q_ref, k_ref, q_out_ref, k_out_ref):
    c, s, p = c_ref[...], s_ref[...], p_ref[...]
    _rotate_heads(q_ref, q_out_ref, c, s, p)
    _rotate_heads(k_ref, k_out_ref, c, s, p)


@functools.partial(jax.jit, static_argnames=("is_neox", "interpret"))
def _rope_tpu(positions, q, k, cos_sin_cache, is_neox, interpret):
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    c, s = pair_tables(positions, cos_sin_cache, head_dim, is_neox)
    p = jnp.asarray(rotation_matrix(head_dim, cos_sin_cache.shape[-1], is_neox))
    # q/k blocks are [block_tokens, heads, D]: the last two dims are whole, so any block_tokens is
    # legal for them; the C/S blocks [block_tokens, D] need a multiple of 8 rows.
    row_bytes = (q_heads + k_heads) * head_dim * 4 * 2
    block_tokens = max(8, min(256, (2 << 20) // row_bytes // 8 * 8, round_up(tokens, 8)))
    padded = round_up(tokens, block_tokens)
    table_spec = pl.BlockSpec((block_tokens, head_dim), lambda i: (i, 0))
    q_spec = pl.BlockSpec((block_tokens, q_heads, head_dim), lambda i: (i, 0, 0))
    k_spec = pl.BlockSpec((block_tokens, k_heads, head_dim), lambda i: (i, 0, 0))
    q_out, k_out = pl.pallas_call(
        _tpu_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((padded, q_heads, head_dim), q.dtype),
            jax.ShapeDtypeStruct((padded, k_heads, head_dim), k.dtype),
        ),
        grid=(padded // block_tokens,),
        in_specs=[
            table_spec,
            table_spec,
            pl.BlockSpec((head_dim, head_dim), lambda i: (0, 0)),
            q_spec,
            k_spec,
        ],
        out_specs=(q_spec, k_spec),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=tpu_params("parallel"),
        interpret=interpret,
    )(pad_to(c, 0, padded), pad_to(s, 0, padded), p, pad_to(q, 0, padded), pad_to(k, 0, padded))
    return q_out[:tokens], k_out[:tokens]


def rotary_embedding_pallas_tpu(positions, q, k, cos_sin_cache, is_neox: bool = True, *, interpret=None):
    """Returns the rotated (q, k); the Mosaic TPU kernel (interpreted off-TPU)."""
    interpret = tpu_interpret() if interpret is None else interpret
    if q.shape[0] == 0:
        return q, k
    return _rope_tpu(positions, q, k, cos_sin_cache, is_neox=bool(is_neox), interpret=interpret)


ROTARY_EMBEDDING.register_jax("pallas_tpu", rotary_embedding_pallas_tpu)
