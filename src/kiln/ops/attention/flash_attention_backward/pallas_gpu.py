"""flash_attention_backward as Pallas Triton (GPU) kernels (the Pallas interpreter off a GPU), on a
padded batch. FlashAttention-2's backward: P = exp(s - lse) is recomputed from q, k and the forward's
saved LSE (math: spec.py), in two kernels so that neither needs atomics or a [q_len, k_len] buffer:
  - dK/dV: grid (B, Hkv, key blocks); a program holds its [block_k, D] keys and values and walks,
    for each query head of its GQA group, the query blocks that can see them (fori_loops over the
    whole q/dO/LSE/delta arrays, loaded by index), accumulating dV += P^T dO and dK += dS^T Q in
    float32 registers, so the group sum needs no second pass.
  - dQ: grid (B, H, query blocks); as the forward (flash_attention's GPU kernel), a program walks
    the key blocks its query block sees, accumulating dQ += dS K.
delta = rowsum(dO * O) - grad_lse is a float32 [B, H, Sq] computed once beforehand (jax.numpy), as
in pallas_tpu.py, whose per-tile math (P and dS of one tile) both kernels share. Blocks are powers of
two of at least 16 rows (tl.dot) and D is zero-padded to a power of two, as Triton needs; padded
query rows (past q_len) and key rows (past kv_len) are masked out.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.attention.flash_attention_backward.pallas_tpu import _probs_and_dscores
from kiln.ops.attention.flash_attention_backward.spec import FLASH_ATTENTION_BACKWARD
from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    kv_block_range,
    over_varlen_backward,
    static_options,
    tile_coords,
)
from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up, squeezed

TRANSPOSED = (((0,), (0,)), ((), ()))  # contract the query rows: P^T dO, dS^T Q
PLAIN = (((1,), (0,)), ((), ()))  # dS K


def q_block_range(k_block, block_q, block_k, q_len, kv_len, causal, window):
    """(first, last) index of the query blocks (of block_q queries, the last q_len of kv_len positions)
    holding a query that sees a key of key block `k_block`; first > last when none does."""
    offset = kv_len - q_len  # query r sits at key position r + offset
    first_key = k_block * block_k
    last_key = jnp.minimum(first_key + block_k - 1, kv_len - 1)
    first_row = jnp.maximum(first_key - offset, 0) if causal else jnp.int32(0)
    last_row = q_len - 1
    if window is not None:  # position - key < window
        last_row = jnp.minimum(last_row, last_key + window - 1 - offset)
    empty = (first_row > last_row) | (first_key >= kv_len)
    first = jax.lax.div(first_row, jnp.int32(block_q))
    last = jax.lax.div(jnp.maximum(last_row, 0), jnp.int32(block_q))
    return first, jnp.where(empty, first - 1, last)


def _dkdv_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
    *, scale, causal, window, softcap, block_q, block_k, group,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    b, hk, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
    k, v = k_ref[...], v_ref[...]  # [block_k, D]
    width = k.shape[-1]
    precision = dot_precision(k.dtype)
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)
    first, last = q_block_range(j, block_q, block_k, q_len, kv_len, causal, window)

    def query_block(i, carry, h):
        dk, dv = carry
        start = pl.multiple_of(i * block_q, block_q)
        rows_at = (b, pl.ds(start, block_q), h, pl.ds(0, width))
        q, do = plgpu.load(q_ref.at[rows_at]), plgpu.load(do_ref.at[rows_at])
        lse = plgpu.load(lse_ref.at[b, h, pl.ds(start, block_q)])[:, None]
        delta = plgpu.load(delta_ref.at[b, h, pl.ds(start, block_q)])[:, None]
        rows, cols = tile_coords(i, j, (block_q, block_k))
        p, ds = _probs_and_dscores(q, k, v, do, lse, delta, rows, cols, q_len, kv_len, **options)
        dv = dv + jax.lax.dot_general(
            p.astype(do.dtype), do, TRANSPOSED, preferred_element_type=jnp.float32, precision=precision
        )
        dk = dk + jax.lax.dot_general(
            ds.astype(q.dtype), q, TRANSPOSED, preferred_element_type=jnp.float32, precision=precision
        )
        return dk, dv

    def head(g, carry):
        return jax.lax.fori_loop(first, last + 1, functools.partial(query_block, h=hk * group + g), carry)

    zeros = jnp.zeros((block_k, width), jnp.float32)
    dk, dv = jax.lax.fori_loop(0, group, head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    b, i = pl.program_id(0), pl.program_id(2)
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
    q, do = q_ref[...], do_ref[...]  # [block_q, D]
    lse, delta = lse_ref[...][:, None], delta_ref[...][:, None]
    precision = dot_precision(q.dtype)
    options = dict(scale=scale, causal=causal, window=window, softcap=softcap)

    def key_block(j, dq):
        start = pl.multiple_of(j * block_k, block_k)
        k = plgpu.load(k_ref.at[pl.ds(start, block_k), :])
        v = plgpu.load(v_ref.at[pl.ds(start, block_k), :])
        rows, cols = tile_coords(i, j, (block_q, block_k))
        _, ds = _probs_and_dscores(q, k, v, do, lse, delta, rows, cols, q_len, kv_len, **options)
        return dq + jax.lax.dot_general(
            ds.astype(k.dtype), k, PLAIN, preferred_element_type=jnp.float32, precision=precision
        )

    first, last = kv_block_range(i, block_q, block_k, q_len, kv_len, causal, window)
    last = jnp.where(i * block_q < q_len, last, first - 1)  # a block of padding rows only: no work
    dq = jax.lax.fori_loop(first, last + 1, key_block, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _backward_gpu(
    dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale, causal, window, softcap, block_q, block_k,
    interpret,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(64, max(16, pl.next_power_of_2(seq_q)))
    block_k = block_k or min(64, max(16, pl.next_power_of_2(seq_k)))
    d = max(16, pl.next_power_of_2(head_dim))
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)

    delta = jnp.swapaxes(jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1), 1, 2)
    if grad_lse is not None:  # a query that sees no key has a constant lse (-inf): no gradient
        delta = delta - jnp.where(lse == NEG_INF, 0.0, grad_lse)
    qp, dop = (pad_to(pad_to(a, 1, sq), 3, d) for a in (q, dout))  # [B, Sq, H, D]
    kp, vp = (pad_to(pad_to(a, 1, sk), 3, d) for a in (k, v))  # [B, Sk, Hkv, D]
    lse_p, delta_p = (pad_to(a.astype(jnp.float32), 2, sq) for a in (lse, delta))  # [B, H, Sq]
    lengths = (q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32))
    statics = dict(
        scale=scale, causal=causal, window=window, softcap=softcap, block_q=block_q, block_k=block_k
    )
    params = plgpu.CompilerParams(num_warps=4, num_stages=2)
    whole = pl.no_block_spec

    # dK, dV: the program's key block by BlockSpec; q, dO, LSE and delta whole, loaded per query block.
    key_spec = pl.BlockSpec((squeezed(), block_k, squeezed(), d), lambda b, hk, j: (b, j, hk, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, group=group, **statics),
        grid=(batch, kv_heads, sk // block_k),
        in_specs=[whole, whole, whole, key_spec, key_spec, whole, whole, whole],
        out_specs=[key_spec, key_spec],
        out_shape=[jax.ShapeDtypeStruct(kp.shape, k.dtype)] * 2,
        compiler_params=params,
        interpret=interpret,
    )(*lengths, qp, kp, vp, dop, lse_p, delta_p)

    # dQ: the program's query block by BlockSpec; its kv head's whole keys and values, per key block.
    row_spec = pl.BlockSpec((squeezed(), block_q, squeezed(), d), lambda b, h, i: (b, i, h, 0))
    stat_spec = pl.BlockSpec((squeezed(), squeezed(), block_q), lambda b, h, i: (b, h, i))
    kv_spec = pl.BlockSpec((squeezed(), sk, squeezed(), d), lambda b, h, i: (b, 0, h // group, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid=(batch, heads, sq // block_q),
        in_specs=[whole, whole, row_spec, kv_spec, kv_spec, row_spec, stat_spec, stat_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=params,
        interpret=interpret,
    )(*lengths, qp, kp, vp, dop, lse_p, delta_p)
    return dq[:, :seq_q, :, :head_dim], dk[:, :seq_k, :, :head_dim], dv[:, :seq_k, :, :head_dim]


def flash_attention_backward_padded_pallas_gpu(
    dout, q, k, v, out, lse, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    grad_lse=None, *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Padded batch (q/dout/out [B, Sq, H, D], k/v [B, Sk, Hkv, D], lse and grad_lse float32
    [B, H, Sq], int32 q_lens/kv_lens [B]) -> (dq, dk, dv) shaped and typed like q, k, v; rows past a
    length get zero gradients. The Pallas Triton kernels (interpreted off a GPU); block_q and block_k
    are powers of two >= 16."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = gpu_interpret() if interpret is None else interpret
    if q.size == 0 or k.size == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    return _backward_gpu(
        dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale=scale, causal=bool(causal), window=window,
        softcap=softcap, block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip


flash_attention_backward_pallas_gpu = over_varlen_backward(flash_attention_backward_padded_pallas_gpu)

FLASH_ATTENTION_BACKWARD.register_jax("pallas_gpu", flash_attention_backward_pallas_gpu)
