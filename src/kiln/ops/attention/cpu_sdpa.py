"""The CPU attention of one sequence that flash_attention and paged_prefill_attention's CPU paths
share: Kiln's native causal kernel (torch.ops.kiln_cpu.causal_attention, cpu_causal_attention.cpp)
for causal float32 attention with the queries at the end of the keys (prefill, chunked prefill),
else PyTorch's fused scaled_dot_product_attention, and explicit float32 matmuls when the scores
themselves are needed (soft-capping, the LSE). Never float64, never a loop over tokens.

Layouts: q `[Lq, H, D]`, k/v `[Lk, Hkv, D]` (the public ops' layout); GQA is handled without
copying the kv heads (SDPA's enable_gqa, or a grouped view for the matmuls).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from kiln.ops import native_cpu
from kiln.ops.attention.reference import visible_keys

_native: dict = {"loaded": None, "off": False}


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    """float32 for half-precision CPU inputs, else q's dtype.

    CPU half-precision attention is slower than float32 (SDPA with a mask falls back to its math
    path for bf16/fp16: 3-15x slower at SmolLM2 decode shapes) and less precise, so all paths
    compute in float32 and round the output once. On a GPU (these functions are also the bench
    baselines) the tensor cores want the half dtype itself.
    """
    if q.device.type == "cpu" and q.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return q.dtype


def attend_math(q, k, v, scale, causal, sliding_window, softcap):
    """q [H, Lq, D], k/v [Hkv, Lk, D] -> (out [H, Lq, D], lse [H, Lq]) with explicit scores."""
    num_heads, q_len, head_dim = q.shape
    num_kv_heads, k_len, _ = k.shape
    group = num_heads // num_kv_heads
    dtype = compute_dtype(q)
    # [Hkv, G*Lq, D] @ [Hkv, D, Lk]: each kv head serves its whole group in one matmul, no repeat.
    scores = torch.matmul(
        q.to(dtype).reshape(num_kv_heads, group * q_len, head_dim), k.to(dtype).transpose(1, 2)
    )
    scores = scores.view(num_heads, q_len, k_len) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal or sliding_window is not None:
        scores.masked_fill_(~visible_keys(q_len, k_len, causal, sliding_window, q.device), -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.matmul(probs.view(num_kv_heads, group * q_len, k_len), v.to(dtype))
    return out.view(num_heads, q_len, head_dim).to(q.dtype), lse.float()


def attend_sdpa(q, k, v, scale, causal, sliding_window):
    """q [H, Lq, D], k/v [Hkv, Lk, D] -> out [H, Lq, D] through SDPA (GQA without copying kv).

    Called with a batch dim of 1: SDPA sends 3-D inputs to its math path, 4-D ones to the CPU flash
    kernel (SmolLM2's 9:3 heads, causal, 2 threads: 99 -> 27 us at 32 tokens, 2.7 -> 0.86 ms at 270)."""
    q_len, k_len = q.shape[1], k.shape[1]
    q, k, v = q[None], k[None], v[None]
    if causal and sliding_window is None and q_len == k_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)[0]
    mask = None
    if causal or sliding_window is not None:
        mask = visible_keys(q_len, k_len, causal, sliding_window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)[0]


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::causal_attention")
    def _(q, k, v, scale, window):
        return torch.empty_like(q)


@contextlib.contextmanager
def without_native():
    """Within it, attend_sequence keeps PyTorch's SDPA / explicit matmuls: the benchmarks' baselines
    (flash_attention's torch_sdpa, paged_prefill_attention's gather_sdpa)."""
    previous, _native["off"] = _native["off"], True
    try:
        yield
    finally:
        _native["off"] = previous


def native_causal_ready(head_dim: int) -> bool:
    """Whether kiln_cpu.causal_attention can run this head dim (the library loads, and builds on a
    host's first call; never while torch.compile traces: the graph keeps SDPA; nor within
    without_native())."""
    if _native["off"] or torch.compiler.is_compiling() or not native_cpu.load_op(_native, _register_fake):
        return False
    return torch.ops.kiln_cpu.causal_attention_head_dim(head_dim)


def attend_native_causal(q, k, v, scale, sliding_window):
    """q [Lq, H, D], k/v [Lk, Hkv, D] float32 CPU, Lk >= Lq, the queries the last Lq positions ->
    out [Lq, H, D]: causal attention (within the last sliding_window keys when set) through Kiln's
    native kernel; requires native_causal_ready(D)."""
    window = -1 if sliding_window is None else int(sliding_window)
    return torch.ops.kiln_cpu.causal_attention(q, k, v, scale, window)


def attend_sequence(q, k, v, scale, causal, sliding_window, softcap, return_lse):
    """One sequence in the public layout: q [Lq, H, D], k/v [Lk, Hkv, D] -> (out [Lq, H, D],
    lse [H, Lq] or None). Scores are materialized only for soft-capping, the LSE or no keys."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if softcap is not None or return_lse or k.shape[0] == 0:
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        out, lse = attend_math(qt, kt, vt, scale, causal, sliding_window, softcap)
        return out.transpose(0, 1), lse
    dtype = compute_dtype(q)
    if (
        causal
        and q.device.type == "cpu"
        and dtype == torch.float32
        and k.shape[0] >= q.shape[0]
        and (sliding_window is None or sliding_window > 0)
        and native_causal_ready(q.shape[-1])
    ):
        out = attend_native_causal(q.to(dtype), k.to(dtype), v.to(dtype), scale, sliding_window)
        return out.to(q.dtype), None
    qt, kt, vt = (t.to(dtype).transpose(0, 1) for t in (q, k, v))
    return attend_sdpa(qt, kt, vt, scale, causal, sliding_window).transpose(0, 1).to(q.dtype), None
