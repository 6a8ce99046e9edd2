"""GGUF (ggml) block codecs for Q4_0, Q4_1 and Q8_0, in torch, byte-compatible with the file format.

A quantized [N, K] tensor is stored row by row, each row K/32 blocks of 32 weights:
    Q4_0: d fp16 (2 bytes) | 16 bytes of nibbles             w = d * (q - 8)        18 bytes / block
    Q4_1: d fp16 | m fp16  | 16 bytes of nibbles             w = d * q + m          20 bytes / block
    Q8_0: d fp16 | 32 int8                                   w = d * q              34 bytes / block
Nibble order (as ggml and `gguf.quants`): byte j holds weight j in its low nibble and weight j + 16
in its high nibble. Decoding in float32 reproduces `gguf.quants.dequantize` bit for bit; the encoders
are ggml's reference round-to-nearest quantizers (as `gguf.quants.quantize`).
Other GGML types decode through the `gguf` package (`dequantize_any`).
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_SIZE = 32
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
KERNEL_QTYPES = tuple(BLOCK_BYTES)


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one quantized row of K weights (K a multiple of 32)."""
    return K // BLOCK_SIZE * BLOCK_BYTES[qtype]


def _blocks(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, K/32, block_bytes]."""
    return qweight.reshape(qweight.shape[0], -1, BLOCK_BYTES[qtype])


def _half(bytes2: torch.Tensor) -> torch.Tensor:
    """[..., 2] little-endian bytes -> fp16 values [..., 1]."""
    return bytes2.contiguous().view(torch.float16)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes -> [..., 32] values 0..15 (low nibbles are weights 0..15)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def dequantize_blocks(qweight: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, K] in `dtype`. Computed in float32 (float64 when asked for it),
    the same operations as ggml, so float32 output is bit-exact with `gguf.quants.dequantize`."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    blocks = _blocks(qweight, qtype)
    d = _half(blocks[..., 0:2]).to(compute)
    if qtype == "Q8_0":
        w = blocks[..., 2:].contiguous().view(torch.int8).to(compute) * d
    elif qtype == "Q4_0":
        w = (_nibbles(blocks[..., 2:]).to(torch.int8) - 8).to(compute) * d
    elif qtype == "Q4_1":
        m = _half(blocks[..., 2:4]).to(compute)
        w = d * _nibbles(blocks[..., 4:]).to(compute) + m
    else:
        raise ValueError(f"dequantize_blocks: qtype {qtype!r} unsupported, expected one of {KERNEL_QTYPES}")
    return w.reshape(qweight.shape[0], -1).to(dtype)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize_blocks(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [N, K] (K a multiple of 32) -> uint8 [N, row_bytes] in the GGUF block layout."""
    N, K = weight.shape
    if K % BLOCK_SIZE:
        raise ValueError(f"quantize_blocks: K={K} must be a multiple of {BLOCK_SIZE} for GGUF blocks")
    x = weight.detach().to(device="cpu", dtype=torch.float32).reshape(N, K // BLOCK_SIZE, BLOCK_SIZE)
    if qtype == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
        parts = [d.half().view(torch.uint8), q]
    elif qtype == "Q4_0":
        imax = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, imax) / -8  # the signed extreme maps to q = 0
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    elif qtype == "Q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8), lo.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
    else:
        raise ValueError(f"quantize_blocks: qtype {qtype!r} unsupported, expected one of {KERNEL_QTYPES}")
    return torch.cat(parts, dim=-1).reshape(N, -1).to(weight.device)


def dequantize_any(data: np.ndarray | torch.Tensor, qtype: str) -> torch.Tensor:
    """Any GGML type (by name, e.g. "Q6_K", "F16") -> float32 tensor via `gguf.quants.dequantize`.
    `data` is the raw uint8 rows (or the tensor's typed data for F16/F32) as stored in the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        ggml_type = GGMLQuantizationType[qtype]
    except KeyError:
        raise ValueError(f"dequantize_any: unknown GGML type {qtype!r}") from None
    array = data.detach().cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
    return torch.from_numpy(np.ascontiguousarray(dequantize(array, ggml_type), dtype=np.float32))
