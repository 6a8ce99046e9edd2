"""Pallas FlashAttention (prefill) kernels, on JAX arrays in jax.nn.dot_product_attention's layout.

    q [B, Sq, H, D], k/v [B, Sk, Hkv, D] (f32/f16/bf16), H % Hkv == 0 (query head h reads kv head
    h // (H // Hkv)); q_lens/kv_lens int32 [B]: the valid length of each batch row (varlen batches
    are padded into B rows); rows past a length are ignored and their outputs are garbage.
    scores = scale * q k^T (then softcap * tanh(scores / softcap)); causal masks are bottom-right
    aligned (query i sees keys j <= i + kv_len - q_len), a sliding window W keeps
    i + kv_len - q_len - j < W. Returns out [B, Sq, H, D] in q's dtype and lse float32 [B, H, Sq]
    (-inf, with out = 0, for a query that sees no key).

Online softmax (FlashAttention-2): a program owns one (batch, head, query block); it walks the key
blocks keeping the running max m, denominator l and unnormalized output acc in float32, rescaling by
exp(m_old - m_new) whenever the max grows; the division by l happens once at the end.

TPU (Mosaic): grid (B, H, q blocks, kv blocks) with the kv axis innermost ("arbitrary") and m/l/acc
in VMEM scratch across it. q/k/v are transposed to [B, H, S, D] so a block's last two dims are
(rows, D) with D the whole dim; lengths are scalar-prefetched into SMEM, so the kv index map clamps
to the last block a query block can see (no DMA for blocks the mask removes) and fully masked
blocks skip their compute.
GPU (Triton lowering): grid (B, H, q blocks); each program loops over kv blocks with fori_loop up
to the last one it can see; D is padded to a power of two, as Triton needs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kiln.ops.pallas_common import gpu_interpret, pad_to, round_up, squeezed, tpu_interpret, tpu_params

NEG_INF = float("-inf")


def visible_mask(rows, cols, offset, kv_len, causal, window):
    """rows: query indices, cols: key indices (broadcastable); the mask of docs/contracts.md."""
    position = rows + offset
    mask = cols < kv_len
    if causal:
        mask &= cols <= position
    if window is not None:
        mask &= position - cols < window
    return mask


def _last_kv_block(q_block, block_q, block_k, q_len, kv_len, causal):
    """Index of the last kv block that query block `q_block` can see (clamped to >= 0)."""
    last_key = kv_len - 1
    if causal:
        last_key = jnp.minimum(last_key, q_block * block_q + block_q - 1 + kv_len - q_len)
    # lax.div (truncating) on a non-negative value: jnp's floor division lowers through sign(), which
    # Mosaic only lowers with a real TPU's info.
    return jax.lax.div(jnp.maximum(last_key, 0), jnp.int32(block_k))


def _first_kv_block(q_block, block_q, block_k, q_len, kv_len, window):
    if window is None:
        return 0
    first_key = q_block * block_q + kv_len - q_len - window + 1
    return jax.lax.div(jnp.maximum(first_key, 0), jnp.int32(block_k))


def _scores(q, k, scale, softcap, precision):
    s = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
    )
    s = s * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def online_softmax_update(s, v, m_prev, l_prev, acc_prev, precision):
    """One FlashAttention-2 step on masked scores s [bq, bk] (masked = -inf)."""
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    m_safe = jnp.where(
        m_new == NEG_INF, 0.0, m_new
    )  # a row with nothing visible yet: no NaN from -inf - -inf
    p = jnp.exp(s - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    pv = jax.lax.dot_general(
        p.astype(v.dtype),
        v,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    return m_new, l_new, alpha * acc_prev + pv


def finish_softmax(m, l, acc):
    seen = l > 0.0
    out = jnp.where(seen, acc / jnp.where(seen, l, 1.0), 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), NEG_INF)
    return out, lse


def dot_precision(dtype):
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None


# ---------------------------------------------------------------- TPU (Mosaic)


def _tpu_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, m_ref, l_ref, acc_ref,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, NEG_INF)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    first = _first_kv_block(i, block_q, block_k, q_len, kv_len, window)
    last = _last_kv_block(i, block_q, block_k, q_len, kv_len, causal)

    @pl.when((j >= first) & (j <= last))
    def _():
        precision = dot_precision(q_ref.dtype)
        s = _scores(q_ref[...], k_ref[...], scale, softcap, precision)
        rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
        cols = j * block_k + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(visible_mask(rows, cols, kv_len - q_len, kv_len, causal, window), s, NEG_INF)
        m, l_, acc = online_softmax_update(s, v_ref[...], m_ref[...], l_ref[...], acc_ref[...], precision)
        m_ref[...], l_ref[...], acc_ref[...] = m, l_, acc

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        out, lse = finish_softmax(m_ref[...], l_ref[...], acc_ref[...])
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _flash_tpu(q, k, v, q_lens, kv_lens, scale, causal, window, softcap, block_q, block_k, interpret):
    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(128, round_up(seq_q, 16))
    block_k = block_k or min(128, round_up(seq_k, 16))
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)
    qt = pad_to(jnp.swapaxes(q, 1, 2), 2, sq)  # [B, H, Sq, D]
    kt, vt = (pad_to(jnp.swapaxes(a, 1, 2), 2, sk) for a in (k, v))

    def kv_index(b, h, i, j, q_lens_ref, kv_lens_ref):
        q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
        first = _first_kv_block(i, block_q, block_k, q_len, kv_len, window)
        last = _last_kv_block(i, block_q, block_k, q_len, kv_len, causal)
        return b, jax.lax.div(h, jnp.int32(group)), jnp.clip(j, first, last), 0

    q_spec = pl.BlockSpec((squeezed(), squeezed(), block_q, head_dim), lambda b, h, i, j, *_: (b, h, i, 0))
    kv_spec = pl.BlockSpec((squeezed(), squeezed(), block_k, head_dim), kv_index)
    lse_spec = pl.BlockSpec((squeezed(), squeezed(), block_q, 1), lambda b, h, i, j, *_: (b, h, i, 0))
    kernel = functools.partial(
        _tpu_kernel,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, heads, sq // block_q, sk // block_k),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=[
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((batch, heads, sq, head_dim), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq, 1), jnp.float32),
        ],
        compiler_params=tpu_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(q_lens, kv_lens, qt, kt, vt)
    return jnp.swapaxes(out[:, :, :seq_q], 1, 2), lse[:, :, :seq_q, 0]


# ---------------------------------------------------------------- GPU (Triton lowering)


def _gpu_kernel(
    q_lens_ref, kv_lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref,
    *, scale, causal, window, softcap, block_q, block_k,
):  # fmt: skip
    from jax.experimental.pallas import triton as plgpu

    b, i = pl.program_id(0), pl.program_id(2)
    q_len, kv_len = q_lens_ref[b], kv_lens_ref[b]
    precision = dot_precision(q_ref.dtype)
    q = q_ref[...]
    rows = i * block_q + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)

    def body(j, carry):
        m, l_, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        k = plgpu.load(k_ref.at[pl.ds(start, block_k), :])
        v = plgpu.load(v_ref.at[pl.ds(start, block_k), :])
        s = _scores(q, k, scale, softcap, precision)
        cols = start + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        s = jnp.where(visible_mask(rows, cols, kv_len - q_len, kv_len, causal, window), s, NEG_INF)
        return online_softmax_update(s, v, m, l_, acc, precision)

    init = (
        jnp.full((block_q, 1), NEG_INF, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    first = _first_kv_block(i, block_q, block_k, q_len, kv_len, window)
    last = _last_kv_block(i, block_q, block_k, q_len, kv_len, causal)
    m, l_, acc = jax.lax.fori_loop(first, last + 1, body, init)
    out, lse = finish_softmax(m, l_, acc)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse[:, 0]


@functools.partial(
    jax.jit, static_argnames=("scale", "causal", "window", "softcap", "block_q", "block_k", "interpret")
)
def _flash_gpu(q, k, v, q_lens, kv_lens, scale, causal, window, softcap, block_q, block_k, interpret):
    from jax.experimental.pallas import triton as plgpu

    batch, seq_q, heads, head_dim = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block_q = block_q or min(64, max(16, pl.next_power_of_2(seq_q)))
    block_k = block_k or min(64, max(16, pl.next_power_of_2(seq_k)))
    d = pl.next_power_of_2(head_dim)
    sq, sk = round_up(seq_q, block_q), round_up(seq_k, block_k)
    qp = pad_to(pad_to(q, 1, sq), 3, d)
    kp, vp = (pad_to(pad_to(a, 1, sk), 3, d) for a in (k, v))
    whole = pl.no_block_spec  # the per-batch lengths: whole [B] arrays, read by index
    q_spec = pl.BlockSpec((squeezed(), block_q, squeezed(), d), lambda b, h, i: (b, i, h, 0))
    kv_spec = pl.BlockSpec((squeezed(), sk, squeezed(), d), lambda b, h, i: (b, 0, h // group, 0))
    lse_spec = pl.BlockSpec((squeezed(), squeezed(), block_q), lambda b, h, i: (b, h, i))
    kernel = functools.partial(
        _gpu_kernel,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        block_q=block_q,
        block_k=block_k,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(batch, heads, sq // block_q),
        in_specs=[whole, whole, q_spec, kv_spec, kv_spec],
        out_specs=[q_spec, lse_spec],
        out_shape=[
            jax.ShapeDtypeStruct((batch, sq, heads, d), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, sq), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(q_lens, kv_lens, qp, kp, vp)
    return out[:, :seq_q, :, :head_dim], lse[:, :, :seq_q]


def _static(scale, window, softcap, head_dim):
    scale = float(head_dim**-0.5 if scale is None else scale)
    return scale, None if window is None else int(window), None if softcap is None else float(softcap)


def flash_attention_pallas_tpu(
    q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Returns (out [B, Sq, H, D], lse [B, H, Sq]); the Mosaic TPU kernel (interpreted off-TPU)."""
    scale, window, softcap = _static(scale, sliding_window, softcap, q.shape[-1])
    interpret = tpu_interpret() if interpret is None else interpret
    return _flash_tpu(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window, softcap=softcap,
        block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip


def flash_attention_pallas_gpu(
    q, k, v, q_lens, kv_lens, causal=True, scale=None, sliding_window=None, softcap=None,
    *, block_q=None, block_k=None, interpret=None,
):  # fmt: skip
    """Returns (out [B, Sq, H, D], lse [B, H, Sq]); the Pallas Triton kernel (interpreted off-GPU)."""
    scale, window, softcap = _static(scale, sliding_window, softcap, q.shape[-1])
    interpret = gpu_interpret() if interpret is None else interpret
    return _flash_gpu(
        q, k, v, q_lens, kv_lens, scale=scale, causal=bool(causal), window=window, softcap=softcap,
        block_q=block_q, block_k=block_k, interpret=interpret,
    )  # fmt: skip
