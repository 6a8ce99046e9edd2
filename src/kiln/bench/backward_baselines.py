"""Plain-PyTorch forwards that `kiln bench --backward` differentiates with torch's own autograd (eager,
and under torch.compile): what training code runs without Kiln. Each takes the op's inputs (the
spec's `make_inputs` names) and returns the outputs the gradient flows from; the Kiln side is
differentiated from the same number of leading outputs (attention: out only, not the LSE).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.attention.reference import visible_keys


def silu_and_mul(x, **_):
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d]) * x[..., d:],)


def gelu_tanh_and_mul(x, **_):
    d = x.shape[-1] // 2
    return (F.gelu(x[..., :d], approximate="tanh") * x[..., d:],)


def rms_norm(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
    if residual is None:
        return (F.rms_norm(x, (x.shape[-1],), weight + weight_offset, eps),)
    s = x + residual
    return F.rms_norm(s, (x.shape[-1],), weight + weight_offset, eps), s


def layer_norm(x, weight, bias=None, eps=1e-5):
    return (F.layer_norm(x, (x.shape[-1],), weight, bias, eps),)


def softmax(x, temperature=1.0):
    return (torch.softmax(x / temperature, dim=-1),)


def rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True):
    """NeoX or GPT-J rotation of the first rotary_dim channels, out of place."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x):
        r = 2 * cos.shape[-1]
        head, tail = x[..., :r], x[..., r:]
        if is_neox:
            x1, x2 = head.chunk(2, dim=-1)
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = head[..., 0::2], head[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rotated, tail], dim=-1)

    return rotate(q), rotate(k)


def fused_linear_cross_entropy(
    hidden, weight, labels, bias=None, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, reduction="mean"
):
    """The unfused loss: the [T, V] logits, then torch's cross_entropy (+ z-loss)."""
    logits = F.linear(hidden, weight, bias).float()
    loss = F.cross_entropy(
        logits, labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
    )
    valid = labels != ignore_index
    if z_loss:
        loss = loss + z_loss * logits.logsumexp(dim=-1)[valid].pow(2).sum()
    return (loss / valid.sum() if reduction == "mean" else loss,)


def flash_attention_with_lse(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
    sliding_window=None, softcap=None,
):  # fmt: skip
    """torch's scaled_dot_product_attention per sequence (kv heads repeated for GQA, the Kiln mask as
    a boolean attn_mask); soft-capping, which SDPA lacks, as explicit math. Returns (out,)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for b in range(len(starts_q) - 1):
        qs = q[starts_q[b] : starts_q[b + 1]].transpose(0, 1)  # [H, q_len, D]
        ks = k[starts_k[b] : starts_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[starts_k[b] : starts_k[b + 1]].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = visible_keys(qs.shape[1], ks.shape[1], causal, sliding_window, q.device)
        if softcap is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
        else:
            scores = softcap * torch.tanh(qs @ ks.transpose(-1, -2) * scale / softcap)
            o = torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1) @ vs
        outs.append(o.transpose(0, 1))
    return (torch.cat(outs),)


BASELINES = {
    "silu_and_mul": silu_and_mul,
    "gelu_tanh_and_mul": gelu_tanh_and_mul,
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "softmax": softmax,
    "rotary_embedding": rotary_embedding,
    "fused_linear_cross_entropy": fused_linear_cross_entropy,
    "flash_attention_with_lse": flash_attention_with_lse,
}
