"""flash_attention_backward: the gradients of flash_attention_with_lse, recomputed from the saved LSE.

dout:          [total_q, num_heads, head_dim]     the gradient of out, q's dtype
q:             [total_q, num_heads, head_dim]     float32 / float16 / bfloat16
k, v:          [total_k, num_kv_heads, head_dim]  same dtype (GQA: query head h reads kv head
               h // (num_heads // num_kv_heads))
out:           [total_q, num_heads, head_dim]     the forward's output, q's dtype
lse:           float32 [num_heads, total_q]       the forward's LSE (natural log, -inf for a query
               that sees no key)
cu_seqlens_q/k, max_seqlen_q/k, causal, scale, sliding_window, softcap: as flash_attention (causal
               bottom-right aligned, the sliding window, soft-capping s -> softcap * tanh(s / softcap))
grad_lse:      optional float32 [num_heads, total_q], the gradient of lse (None: zero)
Returns (dq, dk, dv) shaped and typed like q, k, v; dk and dv sum over the query heads of a group.

With s_ij the (soft-capped) scaled score, P_ij = exp(s_ij - lse_i) over the visible keys:
    dV = P^T dO
    dP = dO V^T
    delta_i = sum_d dO_id O_id - grad_lse_i
    dS = P * (dP - delta)            (times 1 - tanh^2 of the cap when soft-capping)
    dQ = scale dS K,   dK = scale dS^T Q
P is recomputed from q, k and the saved LSE, so nothing of size [q_len, k_len] is kept from the
forward. The reference is autograd through the float64 forward reference (out and lse unused).
"""

from __future__ import annotations

import torch

from kiln.ops.attention.flash_attention.spec import (
    FLASH_ATTENTION,
    flash_attention_with_lse_reference,
    validate_flash_attention,
    varlen_call_case,
)
from kiln.ops.attention.paged_inputs import lengths, visible_pairs
from kiln.ops.checks import check_tensor, device_of, dtype_name
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randn

OP = "flash_attention_backward"
LSE_DTYPES = (torch.float32, torch.float64)  # float64 only for the verifier's reference


def flash_attention_backward_reference(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=True,
    scale=None,
    sliding_window=None,
    softcap=None,
    grad_lse=None,
):
    """(dq, dk, dv) by autograd through flash_attention_with_lse_reference (out and lse are recomputed,
    not read). A query that sees no key has lse -inf, a constant: its grad_lse is dropped."""
    with torch.enable_grad():
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out_ref, lse_ref = flash_attention_with_lse_reference(
            *leaves, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
            sliding_window, softcap,
        )  # fmt: skip
        outputs, upstream = [out_ref], [dout.to(out_ref.dtype)]
        if grad_lse is not None:
            outputs.append(lse_ref)
            upstream.append(torch.where(torch.isfinite(lse_ref), grad_lse.to(lse_ref.dtype), 0.0))
        if not out_ref.requires_grad:  # nothing reached the inputs (no sequences)
            return tuple(torch.zeros_like(t) for t in (q, k, v))
        grads = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v), strict=True))


def _check_like(name, tensor, like, device) -> None:
    tensor = check_tensor(OP, name, tensor, ndim=like.ndim, dtypes=(like.dtype,), device=device)
    if tuple(tensor.shape) != tuple(like.shape):
        raise ValueError(f"{OP}: {name} has shape {tuple(tensor.shape)}, expected q's {tuple(like.shape)}")


def _check_lse(name, lse, q, device) -> None:
    lse = check_tensor(OP, name, lse, ndim=2, dtypes=LSE_DTYPES, device=device)
    expected = (q.shape[1], q.shape[0])
    if tuple(lse.shape) != expected:
        raise ValueError(
            f"{OP}: {name} has shape {tuple(lse.shape)}, expected [num_heads, total_q] {expected}"
        )


def validate_flash_attention_backward(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
    sliding_window, softcap, grad_lse,
) -> None:  # fmt: skip
    validate_flash_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap,
    )  # fmt: skip
    device = device_of(q)
    _check_like("dout", dout, q, device)
    _check_like("out", out, q, device)
    _check_lse("lse", lse, q, device)
    if grad_lse is not None:
        _check_lse("grad_lse", grad_lse, q, device)
        if dtype_name(grad_lse.dtype) != dtype_name(lse.dtype):
            raise ValueError(
                f"{OP}: grad_lse is {dtype_name(grad_lse.dtype)}, expected lse's {dtype_name(lse.dtype)}"
            )


def backward_tune_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal) -> dict:
    """The tuning-cache key (read from shapes only, never device memory); the launcher's lookup uses
    it and `kiln tune` stores under what the launcher asks for. `causal` is in it, as in the forward's
    `flash_tune_shape`: a causal program skips the key tiles past the diagonal, so the work per program
    and the best owned/streamed tile sizes can differ from the full (non-causal) case."""
    return {
        "batch": cu_seqlens_q.shape[0] - 1,
        "seqlen_q": max_seqlen_q,
        "seqlen_k": max_seqlen_k,
        "num_heads": q.shape[1],
        "num_kv_heads": k.shape[1],
        "head_dim": q.shape[2],
        "causal": causal,
    }


def _make_inputs(shape, dtype, device, generator):
    """flash_attention's inputs, then out and lse from the float64 forward reference on the rounded
    q/k/v (so the backward sees a consistent forward), a random dout and, if asked, grad_lse."""
    inputs = FLASH_ATTENTION.make_inputs(shape, dtype, device, generator)
    forward = {k: v.to(torch.float64) if k in ("q", "k", "v") else v for k, v in inputs.items()}
    out, lse = flash_attention_with_lse_reference(**forward)
    q = inputs["q"]
    inputs["dout"] = randn(q.shape, dtype, device, generator)
    inputs["out"] = out.to(dtype)
    inputs["lse"] = lse.to(torch.float32)
    inputs["grad_lse"] = randn(lse.shape, torch.float32, device, generator) if shape.get("grad_lse") else None
    return inputs


def _fuzz_shapes(rng):
    shapes = [
        {"seqlens_q": [1, 7], "seqlens_k": [1, 7], "num_heads": 2, "num_kv_heads": 2, "head_dim": 64},
        {"seqlens_q": [33, 5, 1], "seqlens_k": [33, 21, 19], "num_heads": 3, "num_kv_heads": 1,
         "head_dim": 64, "grad_lse": True},
        {"seqlens_q": [29], "seqlens_k": [29], "num_heads": 4, "num_kv_heads": 2, "head_dim": 80,
         "sliding_window": 7, "softcap": 5.0},
        {"seqlens_q": [18, 33], "seqlens_k": [40, 33], "num_heads": 2, "num_kv_heads": 2, "head_dim": 96,
         "causal": False},
        # more queries than keys: the first 13 queries see no key
        {"seqlens_q": [20], "seqlens_k": [7], "num_heads": 2, "num_kv_heads": 1, "head_dim": 64},
        # a window of 1: each query sees one key, so dq and dk come from grad_lse alone (without it
        # they are exactly zero, and no relative error can be taken of them)
        {"seqlens_q": [9, 17], "seqlens_k": [12, 17], "num_heads": 2, "num_kv_heads": 1, "head_dim": 64,
         "sliding_window": 1, "grad_lse": True},
    ]  # fmt: skip
    q_lens = [rng.randint(1, 40) for _ in range(2)]
    shapes.append(
        {
            "seqlens_q": q_lens,
            "seqlens_k": [n + rng.randint(0, 20) for n in q_lens],
            "num_heads": 6,
            "num_kv_heads": rng.choice([1, 2, 3, 6]),
            "head_dim": rng.choice([64, 128]),
            "causal": rng.choice([True, False]),
            "sliding_window": rng.choice([None, rng.randint(2, 30)]),  # 1: the fixed shape above
        }
    )
    return shapes


def _pairs(shape):
    lens_q, lens_k = lengths(shape, "seqlens_q", "seqlen_q"), lengths(shape, "seqlens_k", "seqlen_k")
    return sum(
        visible_pairs(a, b, shape.get("causal", True), shape.get("sliding_window"))
        for a, b in zip(lens_q, lens_k, strict=True)
    )


def _flops(shape, dtype):
    # Five matmuls per visible (query, key) pair and head: QK^T again, dO V^T, P^T dO, dS K, dS^T Q.
    return 10 * _pairs(shape) * shape["num_heads"] * shape["head_dim"]


def _bytes(shape, dtype):
    tokens_q = sum(lengths(shape, "seqlens_q", "seqlen_q"))
    tokens_k = sum(lengths(shape, "seqlens_k", "seqlen_k"))
    d, heads = shape["head_dim"], shape["num_heads"]
    # read q, out, dout, write dq; read k, v, write dk, dv; lse and delta in float32 (written, read)
    q_side = 4 * tokens_q * heads * d
    k_side = 4 * tokens_k * shape["num_kv_heads"] * d
    return element_size(dtype) * (q_side + k_side) + 4 * 3 * heads * tokens_q


def _torch_math(**inputs):
    """The op's CPU path (explicit matmuls per sequence), run on the bench's device."""
    return FLASH_ATTENTION_BACKWARD.implementation("cpu").fn(**inputs)


def _llm_shapes():
    return [
        {"batch": 1, "seqlen_q": n, "seqlen_k": n, "num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
        for n in (1024, 2048, 4096, 8192)
    ] + [
        {"batch": 4, "seqlen_q": n, "seqlen_k": n, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64}
        for n in (128, 512, 2048)
    ]


def _fake(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


FLASH_ATTENTION_BACKWARD = OpSpec(
    name=OP,
    description="FlashAttention-2 backward (dq, dk, dv) from the saved LSE: causal/GQA/varlen/window/softcap",
    reference=flash_attention_backward_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: exp2 of float32 scores against the float32 LSE, summation order (measured <= 6e-7).
    # Halves: the forward's out is rounded to the input dtype (2^-11 fp16, 2^-8 bf16) and reaches
    # every dS through delta = rowsum(dO * O); the Triton kernels round P and dS for the gradient
    # matmuls too. Measured <= 4.4e-4 in fp16 (CPU and Triton, the fuzz shapes and a 150 x 170 case).
    tolerance={torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3},
    flops=_flops,
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_math": _torch_math},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema=(
        "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal=True, float? scale=None, "
        "int? sliding_window=None, float? softcap=None, Tensor? grad_lse=None) -> (Tensor, Tensor, Tensor)"
    ),
    validate=validate_flash_attention_backward,
    fake=_fake,
    call_case=lambda dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, window, *_: (
        varlen_call_case(q, k, cu_q, cu_k, causal, window)
    ),
    doc=__doc__,
)

flash_attention_backward = define_op(FLASH_ATTENTION_BACKWARD, "kiln.ops")
