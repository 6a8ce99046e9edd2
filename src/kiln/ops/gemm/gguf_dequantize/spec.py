"""gguf_dequantize: GGUF block-quantized weights as stored in the file -> dense [N, K].

    qweight: uint8 [N, row_bytes], row_bytes = K / QK * block bytes
    qtype:   the GGML type's name
    dtype:   the output dtype (float32 / float16 / bfloat16, default float32)
    -> [N, K] in dtype.
Block formats (one output row's K / QK blocks contiguous; the byte layouts: kiln.quant.gguf_blocks):
    Q4_0: fp16 d, 16 bytes of nibbles               w = d * (q - 8)                 18 bytes / 32
    Q4_1: fp16 d, fp16 m, 16 bytes                  w = d * q + m                   20 bytes / 32
    Q5_0: fp16 d, 4 bytes of 5th bits, 16 bytes     w = d * (q - 16)                22 bytes / 32
    Q8_0: fp16 d, 32 int8                           w = d * q                       34 bytes / 32
    Q4_K: fp16 d, dmin, 8 x 6-bit (sc, m), nibbles  w = (d * sc) * q - dmin * m     144 bytes / 256
    Q5_K: Q4_K + 32 bytes of 5th bits               (q in 0..31)                    176 bytes / 256
    Q6_K: 4 + 2 bits, 16 int8 sc, fp16 d            w = (d * sc) * (q - 32)         210 bytes / 256
K-quant super-blocks hold 256 weights: their K is a multiple of 256.
These run the kernels (float32 math without FMA contraction: float32 output is bit-exact with
`gguf.quants.dequantize`). Any other GGML type name ("Q5_1", "IQ4_XS", "F16", ...) falls back to
`gguf.quants.dequantize` on the host, then moves to qweight's device.
"""

from __future__ import annotations

import torch

from kiln.ops.checks import FLOAT_DTYPES, check_tensor
from kiln.ops.gemm.gguf_blocks import QTYPES, make_gguf_weight, packed_bytes, validate_gguf_weight
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import ONE_ROUNDING_POINTWISE, element_size
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, K_QUANTS


def gguf_dequantize_reference(qweight, qtype, dtype=torch.float32):
    """ggml's own decode: the gguf package's `gguf.quants.dequantize` (its float32 arithmetic, which
    defines the format's values), as float64 [N, K] on qweight's device; dtype is what kernels round to.
    Not kiln.quant.gguf_blocks, which the CPU path runs: a codec bug there must fail the check."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # a dependency; imported where it is used
    from gguf.quants import dequantize

    ggml_type = GGMLQuantizationType[qtype]
    block, type_size = GGML_QUANT_SIZES[ggml_type]
    N, K = qweight.shape[0], qweight.shape[1] // type_size * block
    if qweight.numel() == 0:  # the gguf package cannot reshape an empty row
        return torch.zeros(N, K, dtype=torch.float64, device=qweight.device)
    values = torch.from_numpy(dequantize(qweight.cpu().numpy(), ggml_type))
    return values.reshape(N, K).to(device=qweight.device, dtype=torch.float64)


def validate_gguf_dequantize(qweight, qtype, dtype) -> None:
    op = "gguf_dequantize"
    if qtype not in QTYPES:  # decoded on the host by the gguf package, which checks the rest
        check_tensor(op, "qweight", qweight, min_ndim=1)
        return
    validate_gguf_weight(op, qweight, qtype, None)
    if dtype not in FLOAT_DTYPES + (torch.float64,):
        raise ValueError(f"{op}: dtype {dtype} unsupported, expected float32, float16 or bfloat16")


def _call_case(qweight, qtype, dtype):
    """The case of a call: K from the row's bytes (None for types outside QTYPES: no byte model)."""
    if qtype not in QTYPES:
        return None
    K = qweight.shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
    return {"N": qweight.shape[0], "K": K, "qtype": qtype}, dtype


def _fake(qweight, qtype, dtype):
    if qtype in QTYPES:
        block, type_size = BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]
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
    super_blocks = [
        {"N": 1, "K": 256},
        {"N": 9, "K": 512},
        {"N": rng.randint(1, 40), "K": 256 * rng.randint(1, 3)},
    ]
    return [{**s, "qtype": q} for q in QTYPES for s in (super_blocks if q in K_QUANTS else shapes)]


GGUF_DEQUANTIZE = OpSpec(
    name="gguf_dequantize",
    description="GGUF Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K blocks -> dense [N, K]",
    reference=gguf_dequantize_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16),
    # d*q is exact in float32 (11 + 5 bits; K-quants' (d*sc)*q at most 11 + 8 + 6 bits); Q4_1's
    # "+ m" and Q4_K / Q5_K's "- dmin*m" round once (2^-24), as in the reference (ggml's float32), so a
    # kernel doing it ggml's way is exact and one contracting it to an FMA is off by that rounding;
    # halves round the output once (2^-11, 2^-8).
    tolerance={torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3},
    requires=("gguf",),  # the reference decodes with gguf.quants
    pointwise=ONE_ROUNDING_POINTWISE,  # each weight: one float32 product rounded once
    flops=lambda s, dtype: 2.0 * s["N"] * s["K"],
    bytes=lambda s, dtype: packed_bytes(s) + s["N"] * s["K"] * element_size(dtype),
    bench_shapes={
        "llm": [
            {"N": n, "K": k, "qtype": q}
            for k, n in ((4096, 14336), (576, 49152))
            for q in QTYPES
            if k % BLOCK_WEIGHTS[q] == 0  # SmolLM2's K = 576 is not whole K-quant super-blocks
        ]
    },
    schema="(Tensor qweight, str qtype, ScalarType dtype=float32) -> Tensor",
    validate=validate_gguf_dequantize,
    fake=_fake,
    call_case=_call_case,
    doc=__doc__,
)

gguf_dequantize = define_op(GGUF_DEQUANTIZE, "kiln.ops")
