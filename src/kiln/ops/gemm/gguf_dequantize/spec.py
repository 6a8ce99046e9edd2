"""gguf_dequantize: GGUF block-quantized weights as stored in the file -> dense [N, K].

    qweight: uint8 [N, row_bytes], row_bytes = K / 32 * block bytes
    qtype:   the GGML type's name
    dtype:   the output dtype (float32 / float16 / bfloat16, default float32)
    -> [N, K] in dtype.
Block formats (32 weights per block, one output row's K/32 blocks contiguous; see kiln.quant.gguf_blocks):
    Q4_0: fp16 d, 16 bytes of nibbles        w = d * (q - 8)      18 bytes
    Q4_1: fp16 d, fp16 m, 16 bytes           w = d * q + m        20 bytes
    Q8_0: fp16 d, 32 int8                    w = d * q            34 bytes
Byte j of a block's nibbles holds weight j (low nibble) and weight j + 16 (high nibble).
Q4_0 / Q4_1 / Q8_0 run the kernels (float32 math without FMA contraction: float32 output is bit-exact
with `gguf.quants.dequantize`). Any other GGML type name ("Q6_K", "Q5_0", "F16", ...) falls back to
`gguf.quants.dequantize` on the host, then moves to qweight's device.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.gemm.gguf_blocks import QTYPES, make_gguf_weight, packed_bytes, validate_gguf_weight
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_SIZE, dequantize_blocks


def gguf_dequantize_reference(qweight, qtype, dtype=torch.float32):
    """Exact decode in float64 (dtype is what kernels round to)."""
    return dequantize_blocks(qweight, qtype, torch.float64)


def validate_gguf_dequantize(qweight, qtype, dtype) -> None:
    op = "gguf_dequantize"
    if qtype not in QTYPES:  # decoded on the host by the gguf package, which checks the rest
        check_tensor(op, "qweight", qweight, min_ndim=1)
        return
    validate_gguf_weight(op, qweight, qtype, None)
    if dtype not in FLOAT_DTYPES + (torch.float64,):
        raise ValueError(f"{op}: dtype {dtype} unsupported, expected float32, float16 or bfloat16")


def _fake(qweight, qtype, dtype):
    if qtype in QTYPES:
        block, type_size = BLOCK_SIZE, BLOCK_BYTES[qtype]
    else:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        except KeyError:
            raise ValueError(f"gguf_dequantize: unknown GGML type {qtype!r}") from None
    return qweight.new_empty((qweight.shape[0], qweight.shape[1] // type_size * block), dtype=dtype)


def _make_inputs(shape, dtype, device, generator):
    return {"qweight": make_gguf_weight(shape, device, generator), "qtype": shape["qtype"], "dtype": dtype}


def _fuzz_shapes(rng):
    shapes = [
        {"N": 1, "K": 32},
        {"N": 7, "K": 96},
        {"N": 33, "K": 320},
        {"N": rng.randint(1, 60), "K": 32 * rng.randint(1, 12)},
    ]
    return [{**s, "qtype": q} for s in shapes for q in QTYPES]


GGUF_DEQUANTIZE = OpSpec(
    name="gguf_dequantize",
    description="GGUF Q4_0/Q4_1/Q8_0 blocks -> dense [N, K]",
    reference=gguf_dequantize_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # d*q is exact in float32 (11 + 5 bits); Q4_1's "+ m" rounds once (2^-24); halves round the
    # output once (2^-11, 2^-8).
    tolerance={torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3},
    flops=lambda s, dtype: 2.0 * s["N"] * s["K"],
    bytes=lambda s, dtype: packed_bytes(s) + s["N"] * s["K"] * element_size(dtype),
    bench_shapes={
        "llm": [{"N": n, "K": k, "qtype": q} for k, n in ((4096, 14336), (576, 49152)) for q in QTYPES]
    },
    schema="(Tensor qweight, str qtype, ScalarType dtype=float32) -> Tensor",
    validate=validate_gguf_dequantize,
    fake=_fake,
    doc=__doc__,
)

gguf_dequantize = define_op(GGUF_DEQUANTIZE, "kiln.ops")
