"""qk_norm_rope: per-head RMSNorm of the queries and keys, then rotary embedding, in place (Qwen3).

positions:        [T] int64 (or int32), each in [0, max_position)
q:                [T, Hq, D] float32 / float16 / bfloat16, modified in place
k:                [T, Hk, D] same dtype and D as q (Hk may differ from Hq: GQA), modified in place
q_weight, k_weight: [D] same dtype as q (the q_norm / k_norm weights, shared by every head)
cos_sin_cache:    [max_position, rotary_dim] any float dtype (from `kiln.ops.rope_cos_sin_cache`),
                  rotary_dim even and <= D
For every token t and head h of q (likewise k with k_weight):
    y = x / sqrt(mean(x^2) + eps) * q_weight        (x = q[t, h, :], the mean over all D dims)
then the first rotary_dim dims of y are rotated by the angles of positions[t] exactly as
`rotary_embedding` does (c, s = cache[p, :r], cache[p, r:], r = rotary_dim // 2):
    y1' = y1 * c - y2 * s,  y2' = y2 * c + y1 * s
NeoX style (is_neox=True, Qwen3): pairs (i, i + r); GPT-J style: pairs (2i, 2i + 1). Dims
rotary_dim..D-1 keep y. Math in float32 with one rounding to q's dtype at the end (the unfused
HF model rounds after the norm too; the difference is within that rounding).
q and k need a unit stride in the last dim (token and head strides are free, so views into a
fused qkv buffer work). Returns (q, k) (the custom op `torch.ops.kiln.qk_norm_rope` returns
nothing).
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of
from kiln.ops.norm.rms_norm import rms_norm
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.rope.rotary_embedding import rotary_embedding
from kiln.ops.rope.rotary_embedding.spec import q_and_k_inputs, rope_call_case
from kiln.ops.testing import (
    ONE_ROUNDING_POINTWISE,
    ONE_ROUNDING_TOLERANCE,
    compute_dtype,
    element_size,
    randint,
    randn,
)


def _norm_rotate_reference(x, weight, cos, sin, eps, is_neox):
    """x [T, H, D] normalized over D, scaled by weight [D], first rotary_dim dims rotated; in place."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(xf.dtype)
    rotary_dim = 2 * cos.shape[-1]
    if is_neox:
        y1, y2 = y[..., : rotary_dim // 2], y[..., rotary_dim // 2 : rotary_dim]
    else:
        y1, y2 = y[..., 0:rotary_dim:2], y[..., 1:rotary_dim:2]
    out1, out2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
    rotated = torch.cat([out1, out2], -1) if is_neox else torch.stack([out1, out2], -1).flatten(-2)
    x.copy_(torch.cat([rotated, y[..., rotary_dim:]], -1).to(x.dtype))


def qk_norm_rope_reference(positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True):
    cos, sin = cos_sin_cache[positions].to(compute_dtype(q.dtype)).chunk(2, dim=-1)  # [T, r] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    _norm_rotate_reference(q, q_weight, cos, sin, eps, is_neox)
    _norm_rotate_reference(k, k_weight, cos, sin, eps, is_neox)
    return q, k


def validate_qk_norm_rope(positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True) -> None:
    op = "qk_norm_rope"
    check_tensor(op, "positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    device = device_of(positions)
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES + (torch.float64,), device=device)
    check_tensor(op, "k", k, ndim=3, dtypes=(q.dtype,), device=device)
    head_dim = q.shape[-1]
    for name, weight in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(op, name, weight, ndim=1, device=device)
        check_last_dim(op, name, weight, head_dim, "q's head_dim")
    check_same_dtype(op, q=q, q_weight=q_weight, k_weight=k_weight)
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
                f"{op}: {name} must have a unit stride in its last dim (it is normalized and rotated in "
                f"place; got strides {t.stride()}); pass a contiguous tensor"
            )
    if k.shape[-1] != head_dim:
        raise ValueError(f"{op}: k has head_dim {k.shape[-1]}, expected q's head_dim {head_dim}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"{op}: cos_sin_cache has rotary_dim {rotary_dim} (last dim), expected an even "
            f"size <= head_dim {head_dim}"
        )
    if not eps > 0:
        raise ValueError(f"{op}: eps must be positive, got {eps}")


def _make_inputs(shape, dtype, device, generator):
    tokens, head_dim = shape["tokens"], shape["head_dim"]
    rotary_dim = shape.get("rotary_dim", head_dim)
    max_position = shape.get("max_position", 4096)
    return {
        "positions": randint((tokens,), 0, max_position, torch.int64, device, generator),
        **q_and_k_inputs(shape, dtype, device, generator),
        "q_weight": randn((head_dim,), dtype, device, generator, scale=0.5) + 1.0,
        "k_weight": randn((head_dim,), dtype, device, generator, scale=0.5) + 1.0,
        "cos_sin_cache": rope_cos_sin_cache(
            rotary_dim, max_position, shape.get("base", 1000000.0), device=device
        ),
        "eps": 1e-6,
        "is_neox": shape.get("is_neox", True),
    }


def _fuzz_shapes(rng):
    shapes = [
        {"tokens": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 2},
        {"tokens": 5, "q_heads": 16, "kv_heads": 8, "head_dim": 128},  # Qwen3-0.6B heads
        {"tokens": 3, "q_heads": 4, "kv_heads": 2, "head_dim": 64, "fused_qkv": True},  # the engine's views
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
    return shape["tokens"] * (shape["q_heads"] + shape["kv_heads"]) * shape["head_dim"]


def _flops(shape, dtype):
    # norm: square, add, scale by 1/rms, scale by weight (4 per element); rotation: 3 per rotated element
    rotated = (
        shape["tokens"] * (shape["q_heads"] + shape["kv_heads"]) * shape.get("rotary_dim", shape["head_dim"])
    )
    return 4 * _elements(shape) + 3 * rotated


def _bytes(shape, dtype):
    # q and k read and written once, both weights, the tokens' cache rows (float32) and positions.
    cache_row = shape.get("rotary_dim", shape["head_dim"]) * 4
    weights = 2 * shape["head_dim"] * element_size(dtype)
    return 2 * _elements(shape) * element_size(dtype) + weights + shape["tokens"] * (cache_row + 8)


def _llm_shapes():
    models = [  # (q heads, kv heads, head_dim)
        (16, 8, 128),  # Qwen3-0.6B / 1.7B
        (32, 8, 128),  # Qwen3-8B
        (32, 4, 128),  # Qwen3-30B-A3B
    ]
    return [
        {"tokens": tokens, "q_heads": hq, "kv_heads": hk, "head_dim": d, "max_position": 8192}
        for hq, hk, d in models
        for tokens in (1, 64, 4096)
    ]


def _torch_eager(positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True):
    """Unfused eager PyTorch in the input dtype, the way an HF Qwen3 layer does it (NeoX pairs)."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None, :], torch.cat([sin, sin], -1)[:, None, :]
    rotary_dim = cos_sin_cache.shape[-1]
    out = []
    for x, weight in ((q, q_weight), (k, k_weight)):
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
        rot = x[..., :rotary_dim]
        half = rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
        out.append(torch.cat([rot * cos + rotated * sin, x[..., rotary_dim:]], -1))
    return tuple(out)


def _kiln_unfused(positions, q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6, is_neox=True):
    """Kiln's own rms_norm (one launch per tensor) then rotary_embedding: what the fusion saves."""
    q = rms_norm(q, q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    return rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


QK_NORM_ROPE = OpSpec(
    name="qk_norm_rope",
    description="per-head RMSNorm of q and k then rotary embedding, in place (Qwen3 attention)",
    reference=qk_norm_rope_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # fp32: summation order of the mean and a few products (a few ulps); halves: one rounding of each
    # output element (2^-11, 2^-8), as rms_norm and rotary_embedding.
    tolerance=ONE_ROUNDING_TOLERANCE,
    pointwise=ONE_ROUNDING_POINTWISE,
    flops=_flops,
    bytes=_bytes,
    outputs=lambda result, inputs: (inputs["q"], inputs["k"]),
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_eager": _torch_eager, "kiln_unfused": _kiln_unfused},
    # q and k are written in place: the custom op returns nothing, the public function (q, k).
    schema=(
        "(Tensor positions, Tensor(a1!) q, Tensor(a2!) k, Tensor q_weight, Tensor k_weight, "
        "Tensor cos_sin_cache, float eps=1e-06, bool is_neox=True) -> ()"
    ),
    validate=validate_qk_norm_rope,
    fake=lambda positions, q, k, q_weight, k_weight, cos_sin_cache, eps, is_neox: None,
    call_case=lambda positions, q, k, q_weight, k_weight, cos_sin_cache, eps, is_neox: rope_call_case(
        q, k, cos_sin_cache
    ),
    public_result=lambda result, args: (args[1], args[2]),
    doc=__doc__,
)

qk_norm_rope = define_op(QK_NORM_ROPE, "kiln.ops")
