"""kiln.jax.flash_attention in jax.nn.dot_product_attention's padded-batch layout: a layout adapter.

The op flash_attention (kiln.ops, torch.ops.kiln, and `kiln.jax.flash_attention_with_lse`, generated
from its spec) is varlen: q [total_q, H, D] with sequences delimited by cu_seqlens. JAX models hold
attention inputs as padded batches [B, S, H, D] instead (kiln.jax.llama_layer does), which is also
the layout the Pallas and XLA kernels compute in; this entry calls those kernels directly, without
a varlen round trip. Same kernels, masks and numerics as the op.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.jax.attention_autodiff import attend
from kiln.ops.attention.flash_attention.pallas_gpu import flash_attention_padded_pallas_gpu
from kiln.ops.attention.flash_attention.pallas_tpu import flash_attention_padded_pallas_tpu
from kiln.ops.attention.flash_attention.xla import flash_attention_padded_xla
from kiln.ops.attention.validate import check_attention_options, check_heads
from kiln.ops.checks import FLOAT_DTYPES, check_same_dtype, check_tensor
from kiln.ops.pallas_common import resolve

PADDED_KERNELS = {
    "pallas_tpu": flash_attention_padded_pallas_tpu,
    "pallas_gpu": flash_attention_padded_pallas_gpu,
    "xla": flash_attention_padded_xla,
}


def _validate(q, k, v, scale, sliding_window, softcap, q_lens, kv_lens) -> None:
    op = "flash_attention"
    check_tensor(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    check_tensor(op, "k", k, ndim=4)
    check_tensor(op, "v", v, ndim=4)
    check_same_dtype(op, q=q, k=k, v=v)
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{op}: v has shape {tuple(v.shape)}, expected k's {tuple(k.shape)}")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"{op}: k has shape {tuple(k.shape)}, expected [{q.shape[0]}, seq_k, num_kv_heads, {q.shape[3]}]"
        )
    check_heads(op, q.shape[2], k.shape[2])
    check_attention_options(op, scale, sliding_window, softcap)
    if sliding_window is not None and int(sliding_window) != sliding_window:
        raise ValueError(f"{op}: sliding_window must be an int, got {sliding_window!r}")
    for name, lens in (("q_lens", q_lens), ("kv_lens", kv_lens)):
        if lens is not None:
            check_tensor(op, name, lens, ndim=1, dtypes=(jnp.int32,))
            if lens.shape[0] != q.shape[0]:
                raise ValueError(f"{op}: {name} has {lens.shape[0]} entries, expected batch {q.shape[0]}")


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = True,
    scale: float | None = None,
    implementation: str | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    q_lens: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    return_lse: bool = False,
):
    """Attention in jax.nn.dot_product_attention's layout: q `[B, Sq, H, D]`, k/v `[B, Sk, Hkv, D]`
    (f32/f16/bf16, H % Hkv == 0) -> out `[B, Sq, H, D]` in q's dtype (and lse float32 `[B, H, Sq]`).

    Causal masks are bottom-right aligned (query i sees keys j <= i + Sk - Sq); `sliding_window` W
    additionally keeps i + Sk - Sq - j < W; `softcap` c maps scores s to c * tanh(s / c). Optional
    `q_lens`/`kv_lens` int32 `[B]` give per-row valid lengths (padded varlen batches); outputs past
    a row's q_len are unspecified. scale defaults to D ** -0.5. `implementation`: None (this
    device's best: pallas_tpu on a TPU, pallas_gpu on a GPU, xla on the CPU) or one of
    pallas_tpu, pallas_gpu, xla. jit-compatible and differentiable in q, k and v (`jax.grad`: behind
    pallas_tpu the Pallas TPU backward kernels, recomputing from the saved LSE, else XLA's autodiff of
    the XLA forward; kiln.jax.attention_autodiff).
    """
    _validate(q, k, v, scale, sliding_window, softcap, q_lens, kv_lens)
    batch = q.shape[0]
    q_lens = jnp.full((batch,), q.shape[1], jnp.int32) if q_lens is None else q_lens
    kv_lens = jnp.full((batch,), k.shape[1], jnp.int32) if kv_lens is None else kv_lens
    kernel = PADDED_KERNELS[resolve("flash_attention", implementation, tuple(PADDED_KERNELS))]
    if q.size == 0 or k.shape[1] == 0:
        out = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full((batch, q.shape[2], q.shape[1]), -jnp.inf, jnp.float32)
    else:
        out, lse = attend(q, k, v, q_lens, kv_lens, kernel, bool(causal), scale, sliding_window, softcap)
    return (out, lse) if return_lse else out
