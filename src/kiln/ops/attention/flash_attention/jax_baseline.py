"""`jax.nn.dot_product_attention` as a flash_attention baseline for `kiln bench`: XLA's own attention
(cuDNN's fused kernel where XLA picks it on a GPU), next to Kiln's Pallas and Triton kernels in one run.

It takes a padded batch, so only uniform batches run (every sequence the same length, q as long as k:
the bench's prefill shapes); softcap is not in its API. Other shapes raise ValueError, which the bench
records as the baseline's error.
"""

from __future__ import annotations

import functools


@functools.cache
def _jitted(causal: bool, scale: float, window: int | None):
    import jax

    # Kiln's window keeps keys j with i - j < window (i itself included): window - 1 to the left
    local = None if window is None else (window - 1, 0)

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, local_window_size=local)

    return jax.jit(attend)


def jax_dot_product_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None,
):  # fmt: skip
    """flash_attention's signature (q [Tq, H, D], k/v [Tk, Hkv, D], packed) -> out [Tq, H, D], through
    jax.nn.dot_product_attention on the batch reshaped to [B, S, H, D]."""
    from kiln.ops.jax_bridge import to_jax, to_torch

    batch = cu_seqlens_q.numel() - 1
    if softcap is not None:
        raise ValueError("jax.nn.dot_product_attention has no softcap")
    if sliding_window is not None and not causal:
        raise ValueError("jax.nn.dot_product_attention baseline: a sliding window only with causal=True")
    uniform = q.shape[0] == batch * max_seqlen_q and k.shape[0] == batch * max_seqlen_k
    if max_seqlen_q != max_seqlen_k or not uniform:
        raise ValueError(
            "jax.nn.dot_product_attention baseline: uniform batches with seqlen_q == seqlen_k only"
        )
    head_dim = q.shape[-1]
    attend = _jitted(bool(causal), float(head_dim**-0.5 if scale is None else scale), sliding_window)

    def padded(x):
        return to_jax(x.reshape(batch, -1, *x.shape[1:]))

    out = attend(padded(q), padded(k), padded(v))
    return to_torch(out, like=q).reshape(q.shape)
