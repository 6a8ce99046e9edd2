"""Fast CPU flash_attention_backward: explicit matmuls per sequence, the scores of one sequence
materialized ([H, q_len, k_len], float32; float64 stays float64 so gradcheck applies), GQA through a
grouped view ([Hkv, G * q_len, ...]) so the kv heads are never copied and dk/dv come out summed over
each group by the matmul itself."""

from __future__ import annotations

import math

import torch

from kiln.ops.alloc import empty_like
from kiln.ops.attention.flash_attention_backward.spec import FLASH_ATTENTION_BACKWARD
from kiln.ops.attention.reference import visible_keys
from kiln.ops.registry import Implementation, cpu_only
from kiln.ops.testing import compute_dtype


def _sequence_grads(dout, q, k, v, lse, grad_lse, scale, causal, sliding_window, softcap):
    """One sequence, heads first: dout/q [H, Lq, D], k/v [Hkv, Lk, D], lse/grad_lse [H, Lq] (compute
    dtype). Returns dq [H, Lq, D], dk and dv [Hkv, Lk, D]. The forward's output is not needed: delta
    comes from the recomputed probabilities."""
    num_heads, q_len, head_dim = q.shape
    num_kv_heads, k_len, _ = k.shape
    rows = (num_heads // num_kv_heads) * q_len  # a kv head's queries: its whole group
    q_grouped = q.reshape(num_kv_heads, rows, head_dim)
    dout_grouped = dout.reshape(num_kv_heads, rows, head_dim)
    scores = torch.matmul(q_grouped, k.transpose(1, 2)).view(num_heads, q_len, k_len) * scale
    if softcap is not None:
        capped = torch.tanh(scores / softcap)
        scores = capped * softcap
    if causal or sliding_window is not None:
        scores = scores.masked_fill(~visible_keys(q_len, k_len, causal, sliding_window, q.device), -math.inf)
    # A query that sees no key has lse -inf and only -inf scores: subtract 0 so exp gives 0, not NaN.
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    probs_grouped = probs.view(num_kv_heads, rows, k_len)
    dv = torch.matmul(probs_grouped.transpose(1, 2), dout_grouped)
    dprobs = torch.matmul(dout_grouped, v.transpose(1, 2)).view(num_heads, q_len, k_len)
    # delta = rowsum(dout * out) = rowsum(probs * dprobs); the second form, from the same dprobs, makes
    # dprobs - delta cancel exactly where it should (one visible key: dq then comes from grad_lse
    # alone; from the op's `out`, the two sums rounded apart and left ~1e-5 relative noise in dq)
    delta = (probs * dprobs).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    dscores = probs * (dprobs - delta[..., None])
    if softcap is not None:
        dscores = dscores * (1.0 - capped * capped)
    dscores_grouped = dscores.view(num_kv_heads, rows, k_len)
    dq = torch.matmul(dscores_grouped, k).view(num_heads, q_len, head_dim) * scale
    dk = torch.matmul(dscores_grouped.transpose(1, 2), q_grouped) * scale
    return dq, dk, dv


def flash_attention_backward_cpu(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
    scale=None, sliding_window=None, softcap=None, grad_lse=None,
):  # fmt: skip
    dq, dk, dv = empty_like(q), empty_like(k), empty_like(v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        qs, qe, ks, ke = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if qe == qs or q.shape[1] == 0:  # keys no query reads get zero gradients
            dq[qs:qe] = 0.0
            dk[ks:ke] = 0.0
            dv[ks:ke] = 0.0
            continue
        heads_first = [t[qs:qe].transpose(0, 1).to(dtype) for t in (dout, q)]
        kv = [t[ks:ke].transpose(0, 1).to(dtype) for t in (k, v)]
        seq_lse = lse[:, qs:qe].to(dtype)
        seq_grad_lse = grad_lse[:, qs:qe].to(dtype) if grad_lse is not None else None
        grads = _sequence_grads(
            heads_first[0], heads_first[1], kv[0], kv[1], seq_lse, seq_grad_lse, scale, causal,
            sliding_window, softcap,
        )  # fmt: skip
        dq[qs:qe] = grads[0].transpose(0, 1)
        dk[ks:ke] = grads[1].transpose(0, 1)
        dv[ks:ke] = grads[2].transpose(0, 1)
    return dq, dk, dv


FLASH_ATTENTION_BACKWARD.register(Implementation("cpu", flash_attention_backward_cpu, cpu_only))
