"""int4_linear: W4A16, group-wise asymmetric int4 weights times half/float activations.

x:          [..., K]  float32 / float16 / bfloat16
qweight:    int32 [N, ceil(K / 8)], packed ALONG K: nibble i (bits 4i..4i+3) of word j is
            q[n, 8j + i] in 0..15 (GPTQ-style nibble order, kept in the checkpoint's [N, K]
            orientation; padding nibbles past K are ignored)
scales:     [N, G] float (any float dtype), G = ceil(K / group_size)
zeros:      uint8 [N, G], zero points 0..15
group_size: 32, 64 or 128
y = x @ W^T with W[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size],
[..., N] in x's dtype. K need NOT be a multiple of group_size (the last group is short) nor of 8.
`kiln.quant.quantize_int4` produces this layout from a float weight.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, row_count
from kiln.ops.gemm.dense_baseline import bf16_matmul
from kiln.ops.gemm.shapes import GEMM_TOLERANCE, fuzz_gemm_shapes, gemm_flops, llm_shapes, quant_shapes
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, randint, randn, uniform
from kiln.quant.int4 import GROUP_SIZES, dequantize_int4


def int4_linear_reference(x, qweight, scales, zeros, group_size):
    """Unpack and dequantize W in float64 from the layout above, then x @ W^T in x's dtype (float64
    under the verifier). Written out here, not through kiln.quant.int4 (the CPU path's decoder), so
    that a packing bug there fails the check instead of being reproduced by it."""
    N, K = qweight.shape[0], x.shape[-1]
    words = qweight.to(torch.int64) & 0xFFFFFFFF  # the int32 word as 32 unsigned bits (nibble 7: sign)
    nibbles = [(words >> (4 * i)) & 0xF for i in range(8)]  # nibble i: bits 4i..4i+3, weight 8j + i
    q = torch.stack(nibbles, dim=-1).reshape(N, 8 * words.shape[1])[:, :K]
    group = torch.arange(K, device=qweight.device) // group_size
    w = (q.double() - zeros[:, group].double()) * scales[:, group].double()
    return x @ w.to(x.dtype).T


def validate_int4_linear(x, qweight, scales, zeros, group_size) -> None:
    op = "int4_linear"
    check_tensor(op, "x", x, min_ndim=1, dtypes=FLOAT_DTYPES + (torch.float64,))
    if group_size not in GROUP_SIZES:
        raise ValueError(f"{op}: group_size {group_size} unsupported, expected one of {GROUP_SIZES}")
    K, device = x.shape[-1], device_of(x)
    check_tensor(op, "qweight", qweight, ndim=2, dtypes=(torch.int32,), device=device)
    N, words, groups = qweight.shape[0], -(-K // 8), -(-K // group_size)
    if qweight.shape[1] != words:
        raise ValueError(
            f"{op}: qweight has shape {tuple(qweight.shape)}, expected [N, ceil(K/8)] = [{N}, {words}] "
            f"for K={K} (8 nibbles per int32 along K)"
        )
    check_tensor(op, "scales", scales, ndim=2, dtypes=FLOAT_DTYPES + (torch.float64,), device=device)
    check_tensor(op, "zeros", zeros, ndim=2, dtypes=(torch.uint8,), device=device)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (N, groups):
            raise ValueError(
                f"{op}: {name} has shape {tuple(t.shape)}, expected [N, ceil(K/group_size)] = [{N}, {groups}]"
            )


def _make_inputs(shape, dtype, device, generator):
    M, N, K, gs = shape["M"], shape["N"], shape["K"], shape["group_size"]
    groups = -(-K // gs)
    return {
        "x": randn((M, K), dtype, device, generator),
        # Random words: every nibble value, including the sign bit of nibble 7.
        "qweight": randint((N, -(-K // 8)), -(2**31), 2**31 - 1, torch.int32, device, generator),
        "scales": uniform((N, groups), 0.5, 1.5, dtype, device, generator) * (0.2 * K**-0.5),
        "zeros": randint((N, groups), 0, 16, torch.uint8, device, generator),
        "group_size": gs,
    }


def _fuzz(rng):
    shapes = fuzz_gemm_shapes(rng)
    return [{**s, "group_size": (32, 64, 128)[i % 3]} for i, s in enumerate(shapes)]


def _bytes(shape, dtype):
    M, N, K = shape["M"], shape["N"], shape["K"]
    groups = -(-K // shape["group_size"])
    packed = N * (-(-K // 8)) * 4 + N * groups * (element_size(dtype) + 1)
    return packed + (M * K + M * N) * element_size(dtype)


def _torch_dequant_matmul(x, qweight, scales, zeros, group_size):
    """What a framework without a fused kernel does: materialize W in x's dtype, then cuBLAS."""
    return x @ dequantize_int4(qweight, scales, zeros, group_size, x.shape[-1], dtype=x.dtype).T


def _bf16_matmul(x, qweight, scales, zeros, group_size):
    """The same layer as a bf16 GEMM on the dequantized weight (dense_baseline)."""
    K = x.shape[-1]
    return bf16_matmul(x, qweight, lambda: dequantize_int4(qweight, scales, zeros, group_size, K))


INT4_LINEAR = OpSpec(
    name="int4_linear",
    description="W4A16 group-wise asymmetric int4 (packed along K), dequantized in registers",
    reference=int4_linear_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # The weight is dequantized in float32 then rounded to x's dtype for the dot (one extra rounding
    # per weight, random in sign): the same budget as a dense GEMM's output rounding.
    tolerance=GEMM_TOLERANCE,
    flops=gemm_flops,
    bytes=_bytes,
    bench_shapes={"llm": llm_shapes(group_size=128), "quant": quant_shapes(group_size=128)},
    baselines={"torch_dequant_matmul": _torch_dequant_matmul, "torch_bf16_matmul": _bf16_matmul},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema="(Tensor x, Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> Tensor",
    validate=validate_int4_linear,
    fake=lambda x, qweight, scales, zeros, group_size: x.new_empty((*x.shape[:-1], qweight.shape[0])),
    call_case=lambda x, qweight, scales, zeros, group_size: (
        {"M": row_count(x), "N": qweight.shape[0], "K": x.shape[-1], "group_size": group_size},
        x.dtype,
    ),
    doc=__doc__,
)

int4_linear = define_op(INT4_LINEAR, "kiln.ops")
