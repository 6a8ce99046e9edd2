"""flash_attention: varlen attention over contiguous q/k/v; flash_attention_with_lse also returns the LSE.

q:             [total_q, num_heads, head_dim]     float32 / float16 / bfloat16
k, v:          [total_k, num_kv_heads, head_dim]  same dtype; num_heads % num_kv_heads == 0 (GQA/MQA:
               query head h reads kv head h // (num_heads // num_kv_heads))
cu_seqlens_q,
cu_seqlens_k:  int32 [batch + 1], prefix sums of the sequence lengths (sequence b's queries are
               rows cu_seqlens_q[b]:cu_seqlens_q[b+1])
max_seqlen_q/k: the longest sequence (sizes the launch grid)
head_dim in (64, 80, 96, 128, 256); scale defaults to head_dim ** -0.5.
scores = scale * q k^T, then softcap * tanh(scores / softcap) when soft-capping; causal masks are
bottom-right aligned (query i of a sequence sees keys j <= i + k_len - q_len) and a sliding
window W additionally keeps i + k_len - q_len - j < W. out = softmax(scores) v in q's dtype.
flash_attention returns out [total_q, num_heads, head_dim]; flash_attention_with_lse returns
(out, lse) with lse float32 [num_heads, total_q] = log(sum_j exp(score_ij)) (-inf for a query
that sees no key). A result's arity is fixed per op, hence two ops (two torch.ops.kiln custom
ops) over one kernel; `kiln.ops.flash_attention(..., return_lse=True)` calls the second.
"""

from __future__ import annotations

import torch

from kiln.ops.attention import cpu_sdpa
from kiln.ops.attention.flash_attention.jax_baseline import jax_dot_product_attention
from kiln.ops.attention.paged_inputs import cu_seqlens, host_lengths, lengths, visible_pairs
from kiln.ops.attention.reference import attend_one_sequence
from kiln.ops.attention.validate import (
    check_attention_options,
    check_cu_seqlens,
    check_heads,
    check_lengths,
    check_query,
)
from kiln.ops.checks import check_tensor, device_of
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randn

OP = "flash_attention"


def flash_attention_with_lse_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal=True,
    scale=None,
    sliding_window=None,
    softcap=None,
):
    out = torch.zeros_like(q)
    lse = torch.zeros(
        q.shape[1],
        q.shape[0],
        dtype=torch.float64 if q.dtype == torch.float64 else torch.float32,
        device=q.device,
    )
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(starts_q) - 1):
        qs, qe, ks, ke = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        o, s = attend_one_sequence(q[qs:qe], k[ks:ke], v[ks:ke], scale, causal, sliding_window, softcap)
        out[qs:qe] = o.to(q.dtype)
        lse[:, qs:qe] = s.to(lse.dtype)
    return out, lse


def flash_attention_reference(*args, **kwargs):
    return flash_attention_with_lse_reference(*args, **kwargs)[0]


def validate_flash_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window, softcap
) -> None:
    q = check_query(OP, "q", q)
    k = check_tensor(OP, "k", k, ndim=3, dtypes=(q.dtype,), device=device_of(q))
    v = check_tensor(OP, "v", v, ndim=3, dtypes=(q.dtype,), device=device_of(q))
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{OP}: v has shape {tuple(v.shape)}, expected k's {tuple(k.shape)}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{OP}: k has head_dim {k.shape[-1]}, expected q's head_dim {q.shape[-1]}")
    check_heads(OP, q.shape[1], k.shape[1])
    num_seqs = check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, None, device_of(q))
    check_cu_seqlens(OP, "cu_seqlens_k", cu_seqlens_k, num_seqs, device_of(q))
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{OP}: {name} must be a non-negative int, got {value!r}")
    check_lengths(OP, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "query")
    check_lengths(OP, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "key")
    check_attention_options(OP, scale, sliding_window, softcap)
    if sliding_window is not None and int(sliding_window) != sliding_window:
        raise ValueError(f"{OP}: sliding_window must be an int, got {sliding_window!r}")


def flash_tune_shape(q, k, cu_seqlens_q, max_seqlen_q, max_seqlen_k, causal) -> dict:
    """The shape dict a launcher can build without reading device memory (the tuning-cache key)."""
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
    lens_q = lengths(shape, "seqlens_q", "seqlen_q")
    lens_k = lengths(shape, "seqlens_k", "seqlen_k")
    heads, kv_heads, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    softcap = shape.get("softcap")
    return {
        # Larger scores when soft-capping, so the cap actually bends them.
        "q": randn((sum(lens_q), heads, head_dim), dtype, device, generator, scale=3.0 if softcap else 1.0),
        "k": randn((sum(lens_k), kv_heads, head_dim), dtype, device, generator),
        "v": randn((sum(lens_k), kv_heads, head_dim), dtype, device, generator),
        "cu_seqlens_q": cu_seqlens(lens_q, device),
        "cu_seqlens_k": cu_seqlens(lens_k, device),
        "max_seqlen_q": max(lens_q),
        "max_seqlen_k": max(lens_k),
        "causal": shape.get("causal", True),
        "scale": shape.get("scale"),
        "sliding_window": shape.get("sliding_window"),
        "softcap": softcap,
    }


def _fuzz_shapes(rng):
    shapes = [
        {"seqlens_q": [1], "seqlens_k": [1], "num_heads": 2, "num_kv_heads": 2, "head_dim": 64},
        {
            "seqlens_q": [37, 5, 1],
            "seqlens_k": [37, 21, 19],
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 64,
        },
        {
            "seqlens_q": [29],
            "seqlens_k": [29],
            "num_heads": 8,
            "num_kv_heads": 1,
            "head_dim": 80,
            "sliding_window": 7,
            "softcap": 5.0,
        },
        {
            "seqlens_q": [18, 33],
            "seqlens_k": [40, 33],
            "num_heads": 3,
            "num_kv_heads": 3,
            "head_dim": 96,
            "causal": False,
        },
    ]
    q_lens = [rng.randint(1, 40) for _ in range(2)]
    shapes.append(
        {
            "seqlens_q": q_lens,
            "seqlens_k": [n + rng.randint(0, 20) for n in q_lens],
            "num_heads": 4,
            "num_kv_heads": rng.choice([1, 2, 4]),
            "head_dim": rng.choice([64, 128]),
            "sliding_window": rng.choice([None, rng.randint(1, 30)]),
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
    return 4 * _pairs(shape) * shape["num_heads"] * shape["head_dim"]  # QK^T and PV, 2 flops per MAC


def _bytes(shape, dtype):
    tokens_q = sum(lengths(shape, "seqlens_q", "seqlen_q"))
    tokens_k = sum(lengths(shape, "seqlens_k", "seqlen_k"))
    d = shape["head_dim"]
    return (
        element_size(dtype) * d * (2 * tokens_q * shape["num_heads"] + 2 * tokens_k * shape["num_kv_heads"])
    )


def _torch_sdpa(**inputs):
    """PyTorch SDPA per sequence: the op's CPU path (cpu.py) without Kiln's native causal kernel, run
    on the bench's device."""
    with cpu_sdpa.without_native():
        return FLASH_ATTENTION.implementation("cpu").fn(**inputs)


def _torch_sdpa_with_lse(**inputs):
    """The CPU path of flash_attention_with_lse (explicit float32 scores), on the bench's device."""
    return FLASH_ATTENTION_WITH_LSE.implementation("cpu").fn(**inputs)


def _llm_shapes():
    shapes = []
    for seqlen in (1024, 2048, 4096, 8192, 16384):  # Llama-3-8B heads, bf16 causal prefill
        shapes.append(
            {
                "batch": 1,
                "seqlen_q": seqlen,
                "seqlen_k": seqlen,
                "num_heads": 32,
                "num_kv_heads": 8,
                "head_dim": 128,
                "causal": True,
            }
        )
    for seqlen in (128, 512, 2048):  # SmolLM2-135M
        shapes.append(
            {
                "batch": 4,
                "seqlen_q": seqlen,
                "seqlen_k": seqlen,
                "num_heads": 9,
                "num_kv_heads": 3,
                "head_dim": 64,
                "causal": True,
            }
        )
    return shapes


_ARGUMENTS = (
    "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
    "int max_seqlen_k, bool causal=True, float? scale=None, int? sliding_window=None, float? softcap=None)"
)


def varlen_call_case(q, k, cu_seqlens_q, cu_seqlens_k, causal, sliding_window):
    """The case of a call on packed q [tokens_q, heads, head_dim], k [tokens_k, kv_heads, head_dim]
    (flash_attention and its backward), or None (`host_lengths`)."""
    lens_q, lens_k = host_lengths(cu_seqlens_q, cumulative=True), host_lengths(cu_seqlens_k, cumulative=True)
    if lens_q is None or lens_k is None:
        return None
    heads = {"num_heads": q.shape[1], "num_kv_heads": k.shape[1], "head_dim": q.shape[2]}
    lens = {"batch": len(lens_q), "seqlens_q": lens_q, "seqlens_k": lens_k}
    return {**lens, **heads, "causal": causal, "sliding_window": sliding_window}, q.dtype


def _fake_out(q, *args):
    return torch.empty_like(q)


def _fake_out_lse(q, *args):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _spec(name, description, reference, fake, returns, baseline) -> OpSpec:
    """The two ops share everything but the reference, the result and the baseline."""
    return OpSpec(
        name=name,
        description=description,
        reference=reference,
        make_inputs=_make_inputs,
        fuzz_shapes=_fuzz_shapes,
        dtypes=(torch.float32, torch.float16, torch.bfloat16),
        # fp32: exp2 and summation order only. Halves: the probabilities are rounded to the input
        # dtype for the PV product and the output is rounded once (2^-11 fp16, 2^-8 bf16, a few
        # roundings deep); the LSE is float32 throughout.
        tolerance={torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3},
        flops=_flops,
        bytes=_bytes,
        bench_shapes={"llm": _llm_shapes()},
        baselines={"torch_sdpa": baseline},
        gpu_only_dtypes={"triton": (torch.bfloat16,)},
        schema=f"{_ARGUMENTS} -> {returns}",
        validate=validate_flash_attention,
        fake=fake,
        call_case=lambda q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, softcap: varlen_call_case(
            q, k, cu_q, cu_k, causal, window
        ),
        doc=__doc__,
    )


FLASH_ATTENTION = _spec(
    OP,
    "varlen FlashAttention-2: causal/GQA/sliding window/softcap",
    flash_attention_reference,
    _fake_out,
    "Tensor",
    _torch_sdpa,
)
# XLA's attention, timed beside Kiln's kernels (its import of jax is deferred to the call)
FLASH_ATTENTION.baselines["jax_dot_product_attention"] = jax_dot_product_attention
FLASH_ATTENTION_WITH_LSE = _spec(
    "flash_attention_with_lse",
    "varlen FlashAttention-2 returning (out, lse): causal/GQA/sliding window/softcap",
    flash_attention_with_lse_reference,
    _fake_out_lse,
    "(Tensor, Tensor)",
    _torch_sdpa_with_lse,
)

_flash_attention = define_op(FLASH_ATTENTION, "kiln.ops")
flash_attention_with_lse = define_op(FLASH_ATTENTION_WITH_LSE, "kiln.ops")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention: q `[total_q, H, D]`, k/v `[total_k, Hkv, D]`, sequences delimited by int32
    cu_seqlens. Returns out `[total_q, H, D]` in q's dtype, or with `return_lse` (out, lse float32
    `[H, total_q]`).

    Kept for compatibility: it calls the op `flash_attention` (`torch.ops.kiln.flash_attention`) or,
    with return_lse, the op `flash_attention_with_lse`; both are generated from their specs and
    verified. See the module docstring (kiln.ops.attention.flash_attention.spec) for the math.
    """
    op = flash_attention_with_lse if return_lse else _flash_attention
    return op(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
        sliding_window,
        softcap,
    )
