"""flash_attention_backward as Pallas Mosaic TPU kernels (the TPU interpreter off a TPU), on a padded batch.

Recomputes P = exp(s - lse) from q, k and the forward's saved LSE (math: spec.py), in two kernels
so that neither needs atomics or a [q_len, k_len] buffer:
  - dK/dV: a program owns one (batch, kv head, key block) and walks every query block of every
    query head of its GQA group (grid axis 3 = group * q blocks, "arbitrary"), accumulating
    dV += P^T dO and dK += scale dS^T Q in float32 VMEM scratch, so the group sum happens in VMEM.
  - dQ: a program owns one (batch, head, query block) and walks the key blocks (as the forward
    does, the kv index map clamped to the blocks the mask leaves), accumulating dQ += scale dS K.
delta = rowsum(dO * O) - grad_lse is a float32 [B, H, Sq] computed once beforehand (jax.numpy).
Padded query rows (past q_len, or the tile padding) are masked out of both kernels; padded key rows
are masked by kv_len. P and dS are rounded to the input dtype for the gradient matmuls (float32
accumulation), as the forward rounds P for P V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.attention.flash_attention_backward.spec import FLASH_ATTENTION_BACKWARD
from kiln.ops.attention.jax_common import (
    NEG_INF,
    dot_precision,
    kv_block_index,
    kv_block_range,
    over_varlen_backward,
    scores,
    static_options,
    tile_coords,
    tile_program,
    visible_mask,
)
from kiln.ops.pallas_common import pad_to, round_up, squeezed, tpu_interpret, tpu_params


def _probs_and_dscores(q, k, v, do, lse, delta, rows, cols, q_len, kv_len, *, scale, causal, window, softcap):
    """One (query block, key block) tile: P [bq, bk] and dS [bq, bk] (float32; zero where masked or
    where the query row is padding), dS already times the soft-cap's derivative."""
    precision = dot_precision(q.dtype)
    s = scores(q, k, scale, softcap, precision)
    visible = visible_mask(rows, cols, kv_len - q_len, kv_len, causal, window) & (rows < q_len)
    # lse is -inf for a query that sees no key: its scores are all masked, so P is 0 either way.
    p = jnp.where(visible, jnp.exp(s - jnp.where(lse == NEG_INF, 0.0, lse)), 0.0)
    dp = jax.lax.dot_general(
        do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    ds = jnp.where(visible, p * (dp - delta), 0.0)  # padded rows' delta is arbitrary
    if softcap is not None:
        capped = s / softcap
        ds = ds * (1.0 - capped * capped)
    return p, ds


def _visible_block(i, j, q_len, kv_len, *, causal, window, block_q, block_k):
    """Whether query block i and key block j share any visible (query, key) pair (the forward's test)."""
    first, last = kv_block_range(i, block_q, block_k, q_len, kv_len, causal, window)
    return (j >= first) & (j <= last) & (i * block_q < q_len)


def _dkdv_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref,
    dk_acc, dv_acc, *, scale, causal, window, softcap, block_q, block_k, q_blocks,
):  # fmt: skip
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    i = jax.lax.rem(t, jnp.int32(q_blocks))
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]

    @pl.when(t == 0)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    options = dict(causal=causal, window=window, block_q=block_q, block_k=block_k)

    @pl.when(_visible_block(i, j, q_len, kv_len, **options))
    def _():
        q, do = q_ref[...], do_ref[...]
        rows, cols = tile_coords(i, j, (block_q, block_k))
        p, ds = _probs_and_dscores(
            q, k_ref[...], v_ref[...], do, lse_ref[...], delta_ref[...], rows, cols, q_len, kv_len,
            scale=scale, causal=causal, window=window, softcap=softcap,
        )  # fmt: skip
        precision = dot_precision(q.dtype)
        transposed = (((0,), (0,)), ((), ()))  # contract the query rows: P^T dO, dS^T Q
        dv_acc[...] += jax.lax.dot_general(
            p.astype(do.dtype), do, transposed, preferred_element_type=jnp.float32, precision=precision
        )
        dk_acc[...] += jax.lax.dot_general(
            ds.astype(q.dtype), q, transposed, preferred_element_type=jnp.float32, precision=precision
        )

    @pl.when(t == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    i, j, q_len, kv_len = tile_program(q_lens_ref, kv_lens_ref)

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    @pl.when(
        _visible_block(i, j, q_len, kv_len, causal=causal, window=window, block_q=block_q, block_k=block_k)
    )
    def _():
        k = k_ref[...]
        rows, cols = tile_coords(i, j, (block_q, block_k))
        _, ds = _probs_and_dscores(
            q_ref[...], k, v_ref[...], do_ref[...], lse_ref[...], delta_ref[...], rows, cols, q_len, kv_len,
            scale=scale, causal=causal, window=window, softcap=softcap,
        )  # fmt: skip
        dq_acc[...] += jax.lax.dot_general(
            ds.astype(k.dtype), k, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
            precision=dot_precision(k.dtype),
        )  # fmt: skip

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _backward_tpu(
    dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale, causal, window, softcap, block_q, block_k,
    interpret,
):  # fmt: skip
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(128, round_up(seq_q, 16))
    block_k = block_k or min(128, round_up(seq_k, 16))
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)
    q_blocks, k_blocks = sq // block_q, sk // block_k

    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, Sq, H]
    delta = jnp.swapaxes(delta, 1, 2)
    if grad_lse is not None:  # a query that sees no key has a constant lse (-inf): no gradient
        delta = delta - jnp.where(lse == NEG_INF, 0.0, grad_lse)
    qt, dot = (pad_to(jnp.swapaxes(a, 1, 2), 2, sq) for a in (q, dout))  # [B, H, Sq, D]
    kt, vt = (pad_to(jnp.swapaxes(a, 1, 2), 2, sk) for a in (k, v))  # [B, Hkv, Sk, D]
    lse_t, delta_t = (pad_to(a.astype(jnp.float32), 2, sq)[..., None] for a in (lse, delta))  # [B, H, Sq, 1]
    statics = dict(
        scale=scale, causal=causal, window=window, softcap=softcap, block_q=block_q, block_k=block_k
    )
    row_block = (squeezed(), squeezed(), block_q, head_dim)
    key_block = (squeezed(), squeezed(), block_k, head_dim)
    stat_block = (squeezed(), squeezed(), block_q, 1)

    # dK, dV: grid (B, Hkv, key blocks, group * query blocks); t -> head hkv * group + t // q_blocks.
    def q_index(b, hk, j, t, *_):
        h = hk * group + jax.lax.div(t, jnp.int32(q_blocks))
        return b, h, jax.lax.rem(t, jnp.int32(q_blocks)), 0

    kv_spec = pl.BlockSpec(key_block, lambda b, hk, j, t, *_: (b, hk, j, 0))
    q_spec, stat_spec = pl.BlockSpec(row_block, q_index), pl.BlockSpec(stat_block, q_index)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, q_blocks=q_blocks, **statics),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, kv_heads, k_blocks, group * q_blocks),
            in_specs=[q_spec, kv_spec, kv_spec, q_spec, stat_spec, stat_spec],
            out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((block_k, head_dim), jnp.float32)] * 2,
        ),
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, sk, head_dim), k.dtype)] * 2,
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q_lens, kv_lens, qt, kt, vt, dot, lse_t, delta_t)

    # dQ: grid (B, H, query blocks, key blocks), the key index clamped to the visible blocks.
    row_spec = pl.BlockSpec(row_block, lambda b, h, i, j, *_: (b, h, i, 0))
    stat_spec = pl.BlockSpec(stat_block, lambda b, h, i, j, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec(key_block, kv_block_index(group, block_q, block_k, causal, window))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, **statics),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, q_blocks, k_blocks),
            in_specs=[row_spec, kv_spec, kv_spec, row_spec, stat_spec, stat_spec],
            out_specs=row_spec,
            scratch_shapes=[pltpu.VMEM((block_q, head_dim), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((batch, heads, sq, head_dim), q.dtype),
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q_lens, kv_lens, qt, kt, vt, dot, lse_t, delta_t)
    unpad = lambda a, n: jnp.swapaxes(a[:, :, :n], 1, 2)  # noqa: E731
    return unpad(dq, seq_q), unpad(dk, seq_k), unpad(dv, seq_k)


def flash_attention_backward_padded_pallas_tpu(
    dout, q, k, v, out, lse, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    grad_lse=None, *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Padded batch (q/dout/out [B, Sq, H, D], k/v [B, Sk, Hkv, D], lse and grad_lse float32
    [B, H, Sq], int32 q_lens/kv_lens [B]) -> (dq, dk, dv) shaped and typed like q, k, v; rows past a
    length get zero gradients. The Mosaic TPU kernels (interpreted off a TPU)."""
    scale, window, softcap = static_options(scale, sliding_window, softcap, q.shape[-1])
    interpret = tpu_interpret() if interpret is None else interpret
    if q.size == 0 or k.size == 0:
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    return _backward_tpu(
        dout, q, k, v, out, lse, q_lens, kv_lens, grad_lse, scale=scale, causal=bool(causal), window=window,
        softcap=softcap, block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip


flash_attention_backward_pallas_tpu = over_varlen_backward(flash_attention_backward_padded_pallas_tpu)

FLASH_ATTENTION_BACKWARD.register_jax("pallas_tpu", flash_attention_backward_pallas_tpu)
