"""sparse24_linear: y = x @ W^T (+ bias) with W 2:4 structured-sparse, stored compressed.

    x:      [..., K] float32 / float16 / bfloat16, K a multiple of 4
    values: [N, K/2] x's dtype, the two kept weights of every group of four along K
    meta:   uint8 [N, ceil(K/8)], the kept positions (two 2-bit indices per group, two groups a byte)
    bias:   [N] x's dtype, or None
    y:      [..., N] in x's dtype, float32 accumulation.
The layout is kiln.quant.sparse24's (compress_24 makes it from a pruned weight). Kernels expand the
weight in registers, so only the compressed bytes (9/16 of a dense fp16 weight) cross from memory.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_last_dim, check_same_dtype, check_tensor, device_of, row_count
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, fuzz_gemm_shapes, gemm_flops, llm_shapes
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randn
from kiln.quant.sparse24 import compress_24, decompress_24, prune_24


def sparse24_linear_reference(x, values, meta, bias=None):
    """Expand W exactly into x's dtype (float64 under the verifier) from the layout above, then matmul.
    Written out here, not through kiln.quant.sparse24 (the CPU path's decoder), so that a layout bug
    there fails the check instead of being reproduced by it."""
    N, K = values.shape[0], x.shape[-1]
    group = torch.arange(K // 4, device=meta.device)
    # group g's nibble: bits 0-3 of byte g // 2 for even g, bits 4-7 for odd g
    nibble = (meta[:, group // 2].to(torch.int64) >> (4 * (group % 2))) & 0xF  # [N, K/4]
    kept = values.to(x.dtype).reshape(N, K // 4, 2)
    w = torch.zeros(N, K // 4, 4, dtype=x.dtype, device=x.device)
    slots = torch.arange(4, device=meta.device)
    for j in range(2):  # kept value j of a group sits at position idx_j = bits 2j..2j+1 of its nibble
        position = (nibble >> (2 * j)) & 3
        w = torch.where(position[..., None] == slots, kept[..., j, None], w)
    out = x @ w.reshape(N, K).T
    return out if bias is None else out + bias.to(x.dtype)


def validate_sparse24_linear(x, values, meta, bias) -> None:
    op, device = "sparse24_linear", device_of(x)
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    K = x.shape[-1]
    if K % 4:
        raise ValueError(f"{op}: x has K={K} in-features, expected a multiple of 4 (2:4 groups)")
    check_tensor(op, "values", values, ndim=2, device=device)
    check_same_dtype(op, x=x, values=values)
    check_last_dim(op, "values", values, K // 2, "half of x's in-features")
    N = values.shape[0]
    check_tensor(op, "meta", meta, ndim=2, dtypes=(torch.uint8,), device=device)
    if tuple(meta.shape) != (N, -(-K // 8)):
        raise ValueError(
            f"{op}: meta has shape {tuple(meta.shape)}, expected [N, ceil(K/8)] = [{N}, {-(-K // 8)}]"
        )
    if bias is not None:
        check_tensor(op, "bias", bias, ndim=1, device=device)
        check_last_dim(op, "bias", bias, N, "values' out-features")
        check_same_dtype(op, x=x, bias=bias)


def _make_inputs(shape, dtype, device, generator):
    M, N, K = shape["M"], shape["N"], shape["K"]
    weight = prune_24(randn((N, K), torch.float32, "cpu", generator, scale=K**-0.5))
    values, meta = compress_24(weight)
    return {
        "x": randn((M, K), dtype, device, generator),
        "values": values.to(dtype=dtype, device=device),
        "meta": meta.to(device),
        "bias": randn((N,), dtype, device, generator) if shape.get("bias") else None,
    }


def _fuzz(rng):
    return [{**s, "bias": i % 2 == 0} for i, s in enumerate(fuzz_gemm_shapes(rng, k_multiple=4))]


def _bytes(shape, dtype):
    M, N, K = shape["M"], shape["N"], shape["K"]
    size = element_size(dtype)
    weight = N * (K // 2) * size + N * -(-K // 8)
    return weight + (M * K + M * N + (N if shape.get("bias") else 0)) * size


def _torch_dense(x, values, meta, bias=None):
    """The dense GEMM on the decompressed weight (what the sparse kernel must beat at decode)."""
    return torch.nn.functional.linear(x, decompress_24(values, meta), bias)


_SEMI_STRUCTURED: dict[tuple, torch.Tensor] = {}


def _torch_semi_structured(x, values, meta, bias=None):
    """PyTorch's 2:4 sparse tensor-core GEMM (cuSPARSELt / CUTLASS; CUDA, fp16/bf16, sizes multiples of
    64): the large-batch baseline. The weight is converted once per weight tensor, outside the timing."""
    if x.device.type != "cuda":
        raise RuntimeError("to_sparse_semi_structured needs a CUDA device")
    key = (values.data_ptr(), tuple(values.shape), values.dtype)
    if key not in _SEMI_STRUCTURED:
        from torch.sparse import to_sparse_semi_structured

        _SEMI_STRUCTURED[key] = to_sparse_semi_structured(decompress_24(values, meta))
    return torch.nn.functional.linear(x, _SEMI_STRUCTURED[key], bias)


SPARSE24_LINEAR = OpSpec(
    name="sparse24_linear",
    description="2:4 sparse weight (kept halves + 2-bit positions) expanded in registers",
    reference=sparse24_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # The expanded weight is exact in x's dtype; what remains is a dense GEMM's output rounding.
    tolerance=GEMM_TOLERANCE,
    flops=gemm_flops,  # dense-equivalent FLOPs: the kernel multiplies the zeros too
    bytes=_bytes,
    bench_shapes={"llm": llm_shapes(bias=False)},
    baselines={"torch_dense": _torch_dense, "torch_semi_structured": _torch_semi_structured},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema="(Tensor x, Tensor values, Tensor meta, Tensor? bias=None) -> Tensor",
    validate=validate_sparse24_linear,
    fake=lambda x, values, meta, bias: x.new_empty((*x.shape[:-1], values.shape[0])),
    call_case=lambda x, values, meta, bias: (
        {"M": row_count(x), "N": values.shape[0], "K": x.shape[-1], "bias": bias is not None},
        x.dtype,
    ),
    doc=__doc__,
)

sparse24_linear = define_op(SPARSE24_LINEAR, "kiln.ops")
