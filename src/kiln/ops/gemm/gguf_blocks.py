"""What gguf_dequantize and gguf_linear share: the GGUF weight argument's contract (uint8 rows of
GGUF blocks; the codecs themselves are kiln.quant.gguf_blocks), input making, and the host decode of
the GGML types no kernel reads.

    qweight: uint8 [N, row_bytes], row_bytes = K / QK * block bytes; QK = 32 (18 bytes Q4_0, 20 Q4_1,
             22 Q5_0, 34 Q8_0) or 256 for the K-quant super-blocks (144 Q4_K, 176 Q5_K, 210 Q6_K)
"""

from __future__ import annotations

import torch

from kiln.ops.checks import check_tensor
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, KERNEL_QTYPES, dequantize_any, quantize_blocks

QTYPES = KERNEL_QTYPES


def validate_gguf_weight(op: str, qweight, qtype: str, K: int | None, device=None) -> None:
    """qweight uint8 [N, row_bytes] of whole `qtype` blocks (one of QTYPES); with K, exactly K / QK
    blocks per row (QK = 32, 256 for the K-quants)."""
    check_tensor(op, "qweight", qweight, ndim=2, dtypes=(torch.uint8,), device=device)
    if qtype not in QTYPES:
        raise ValueError(f"{op}: qtype {qtype!r} unsupported, expected one of {', '.join(QTYPES)}")
    block, qk = BLOCK_BYTES[qtype], BLOCK_WEIGHTS[qtype]
    if qweight.shape[1] % block:
        raise ValueError(
            f"{op}: qweight rows have {qweight.shape[1]} bytes, not whole {block}-byte {qtype} blocks"
        )
    if K is not None:
        if K % qk:
            what = "super-block" if qk > 32 else "block"
            raise ValueError(f"{op}: K={K} must be a multiple of {qk} (the GGUF {qtype} {what} size)")
        if qweight.shape[1] != K // qk * block:
            raise ValueError(
                f"{op}: qweight rows have {qweight.shape[1]} bytes, expected K/{qk} * {block} = "
                f"{K // qk * block} for K={K} ({qtype})"
            )


def make_gguf_weight(shape, device, generator) -> torch.Tensor:
    """uint8 [N, row_bytes] in shape["qtype"], encoded from fresh random floats [N, K]."""
    N, K = shape["N"], shape["K"]
    # Encode fresh random floats: raw random bytes would make inf/NaN block scales.
    weight = torch.randn((N, K), generator=generator) * K**-0.5
    weight[:, ::7] *= 3.0  # uneven blocks: the largest element differs in sign and size block to block
    # sub-block scales that differ 1..5x within a K-quant super-block: reading a neighbour's scale fails
    weight *= (torch.arange(K) // 16 % 5 + 1).to(weight.dtype)
    return quantize_blocks(weight, shape["qtype"]).to(device)


def packed_bytes(shape) -> int:
    """Bytes of the [N, K] weight in shape["qtype"]."""
    return shape["N"] * shape["K"] // BLOCK_WEIGHTS[shape["qtype"]] * BLOCK_BYTES[shape["qtype"]]


def dequantize_on_host(qweight: torch.Tensor, qtype: str, dtype: torch.dtype) -> torch.Tensor:
    """gguf_dequantize of a GGML type outside QTYPES ("Q5_1", "IQ4_XS", "F16", ...): `gguf.quants` on
    the host, then [N, K] in dtype on qweight's device."""
    values = dequantize_any(qweight, qtype)
    return values.reshape(qweight.shape[0], -1).to(device=qweight.device, dtype=dtype)
