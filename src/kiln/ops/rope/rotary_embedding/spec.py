"""rotary_embedding: rotary position embedding, applied in place to the query and key heads.

    positions:     [T] int64 (or int32), each in [0, max_position)
    q:             [T, Hq, D] float32 / float16 / bfloat16, modified in place
    k:             [T, Hk, D] same dtype and D as q (Hk may differ from Hq: GQA), modified in place
    cos_sin_cache: [max_position, rotary_dim] any float dtype (from `kiln.ops.rope_cos_sin_cache`),
                   rotary_dim even and <= D
    For every token t and head, the first rotary_dim dims are rotated by the angles of position
    positions[t]; with c, s = cache[p, :r], cache[p, r:] (r = rotary_dim // 2) and pairs (x1, x2):
        x1' = x1 * c - x2 * s,  x2' = x2 * c + x1 * s
    NeoX style (is_neox=True, Llama): pairs (i, i + r); GPT-J style: pairs (2i, 2i + 1).
    Dims rotary_dim..D-1 are left untouched (partial rotary). Math in float32.
    q and k need a unit stride in the last dim (token and head strides are free, so views into a
    fused qkv buffer work); anything else is rejected, since an in-place op cannot copy.
    Returns (q, k) (the custom op `torch.ops.kiln.rotary_embedding` returns nothing; traced by
    torch.compile, the CPU implementation returns new tensors holding the rotated values, and still
    updates q and k).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.testing import (
    ONE_ROUNDING_POINTWISE,
    ONE_ROUNDING_TOLERANCE,
    compute_dtype,
    element_size,
    fused_qkv_views,
    randint,
    randn,
)


def _rotate_reference(x, cos, sin, is_neox):
    rotary_dim = 2 * cos.shape[-1]
    xf = x[..., :rotary_dim].to(compute_dtype(x.dtype))
    if is_neox:
        x1, x2 = xf[..., : rotary_dim // 2], xf[..., rotary_dim // 2 :]
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out1, out2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rotated = torch.cat([out1, out2], -1) if is_neox else torch.stack([out1, out2], -1).flatten(-2)
    x[..., :rotary_dim] = rotated.to(x.dtype)


def rotary_embedding_reference(positions, q, k, cos_sin_cache, is_neox=True):
    cos, sin = cos_sin_cache[positions].to(compute_dtype(q.dtype)).chunk(2, dim=-1)  # [T, r] each
    _rotate_reference(q, cos[:, None, :], sin[:, None, :], is_neox)
    _rotate_reference(k, cos[:, None, :], sin[:, None, :], is_neox)
    return q, k


def validate_rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True) -> None:
    op = "rotary_embedding"
    check_tensor(op, "positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    device = device_of(positions)
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES + (torch.float64,), device=device)
    check_tensor(op, "k", k, ndim=3, dtypes=(q.dtype,), device=device)
    check_tensor(
        op, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,), device=device
    )
    tokens = positions.shape[0]
    for name, t in (("q", q), ("k", k)):
        if t.shape[0] != tokens:
            raise ValueError(
                f"{op}: {name} has {t.shape[0]} tokens (shape {tuple(t.shape)}), "
                f"expected {tokens} as in positions"
            )
        # Only torch tensors have strides (and are written in place); jax arrays are row-major.
        if isinstance(t, torch.Tensor) and t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(
                f"{op}: {name} must have a unit stride in its last dim (it is rotated in place; "
                f"got strides {t.stride()}); pass a contiguous tensor"
            )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{op}: k has head_dim {k.shape[-1]}, expected q's head_dim {q.shape[-1]}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > q.shape[-1]:
        raise ValueError(
            f"{op}: cos_sin_cache has rotary_dim {rotary_dim} (last dim), expected an even "
            f"size <= head_dim {q.shape[-1]}"
        )


def _make_inputs(shape, dtype, device, generator):
    tokens, head_dim = shape["tokens"], shape["head_dim"]
    rotary_dim = shape.get("rotary_dim", head_dim)
    max_position = shape.get("max_position", 4096)
    return {
        "positions": randint((tokens,), 0, max_position, torch.int64, device, generator),
        **q_and_k_inputs(shape, dtype, device, generator),
        "cos_sin_cache": rope_cos_sin_cache(
            rotary_dim, max_position, shape.get("base", 10000.0), device=device
        ),
        "is_neox": shape.get("is_neox", True),
    }


def q_and_k_inputs(shape, dtype, device, generator) -> dict:
    """q and k, contiguous or (shape["fused_qkv"]) views into one fused QKV buffer, as the engine
    passes them."""
    tokens, head_dim = shape["tokens"], shape["head_dim"]
    if shape.get("fused_qkv"):
        heads = (shape["q_heads"], shape["kv_heads"], head_dim)
        q, k, _ = fused_qkv_views(tokens, *heads, dtype, device, generator)
        return {"q": q, "k": k}
    return {
        "q": randn((tokens, shape["q_heads"], head_dim), dtype, device, generator),
        "k": randn((tokens, shape["kv_heads"], head_dim), dtype, device, generator),
    }


def _fuzz_shapes(rng):
    shapes = [
        {"tokens": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 2},
        {"tokens": 5, "q_heads": 9, "kv_heads": 3, "head_dim": 64},  # SmolLM2-135M heads
        {"tokens": 6, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "fused_qkv": True},  # the engine's views
        {"tokens": 7, "q_heads": 4, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
        {"tokens": 3, "q_heads": 6, "kv_heads": 2, "head_dim": 96, "rotary_dim": 48},
    ]
    for _ in range(3):
        head_dim = rng.randint(1, 80) * 2
        shapes.append(
            {
                "tokens": rng.randint(1, 40),
                "q_heads": rng.randint(1, 12),
                "kv_heads": rng.randint(1, 4),
                "head_dim": head_dim,
                "rotary_dim": rng.randint(1, head_dim // 2) * 2,
                "is_neox": rng.random() < 0.5,
            }
        )
    return shapes


def _elements(shape):
    return (
        shape["tokens"] * (shape["q_heads"] + shape["kv_heads"]) * shape.get("rotary_dim", shape["head_dim"])
    )


def rope_call_case(q, k, cos_sin_cache):
    """The case of a call rotating q [tokens, q_heads, head_dim] and k [tokens, kv_heads, head_dim]."""
    heads = {"q_heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[2]}
    return {"tokens": q.shape[0], **heads, "rotary_dim": cos_sin_cache.shape[-1]}, q.dtype


def _bytes(shape, dtype):
    # q and k rotated part read and written, cache rows read (float32), positions read.
    cache_row = shape.get("rotary_dim", shape["head_dim"]) * 4
    return 2 * _elements(shape) * element_size(dtype) + shape["tokens"] * (cache_row + 8)


def _llm_shapes():
    models = [  # (q heads, kv heads, head_dim)
        (9, 3, 64),  # SmolLM2-135M
        (32, 8, 128),  # Llama-3-8B
        (8, 1, 128),  # Llama-3-70B at TP 8 (64 / 8 query heads, 8 / 8 kv heads)
    ]
    return [
        {"tokens": tokens, "q_heads": hq, "kv_heads": hk, "head_dim": d, "max_position": 8192}
        for hq, hk, d in models
        for tokens in (1, 64, 4096)
    ]


def _torch_eager(positions, q, k, cos_sin_cache, is_neox=True):
    """Unfused eager PyTorch in the input dtype (what an HF-style model does)."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotary_dim = cos_sin_cache.shape[-1]
    for x in (q, k):
        if is_neox:
            x1, x2 = x[..., : rotary_dim // 2].clone(), x[..., rotary_dim // 2 : rotary_dim].clone()
            x[..., : rotary_dim // 2] = x1 * cos - x2 * sin
            x[..., rotary_dim // 2 : rotary_dim] = x2 * cos + x1 * sin
        else:
            x1, x2 = x[..., 0:rotary_dim:2].clone(), x[..., 1:rotary_dim:2].clone()
            x[..., 0:rotary_dim:2] = x1 * cos - x2 * sin
            x[..., 1:rotary_dim:2] = x2 * cos + x1 * sin
    return q, k


ROTARY_EMBEDDING = OpSpec(
    name="rotary_embedding",
    description="rotary position embedding of q and k in place (NeoX or GPT-J pairs, partial rotary)",
    reference=rotary_embedding_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: two products and a sum per element (a few ulps); halves: one rounding of each
    # rotated element (2^-11, 2^-8); the untouched dims compare exactly.
    tolerance=ONE_ROUNDING_TOLERANCE,
    pointwise=ONE_ROUNDING_POINTWISE,
    flops=lambda s, dtype: 3 * _elements(s),
    bytes=_bytes,
    outputs=lambda result, inputs: (inputs["q"], inputs["k"]),
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_eager": _torch_eager},
    # q and k are written in place: the custom op returns nothing, the public function (q, k).
    schema=(
        "(Tensor positions, Tensor(a1!) q, Tensor(a2!) k, Tensor cos_sin_cache, bool is_neox=True) -> ()"
    ),
    validate=validate_rotary_embedding,
    fake=lambda positions, q, k, cos_sin_cache, is_neox: None,
    call_case=lambda positions, q, k, cos_sin_cache, is_neox: rope_call_case(q, k, cos_sin_cache),
    public_result=lambda result, args: (args[1], args[2]),
    doc=__doc__,
)

rotary_embedding = define_op(ROTARY_EMBEDDING, "kiln.ops")
