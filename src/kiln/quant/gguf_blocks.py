"""GGUF (ggml) block codecs for Q4_0, Q4_1 and Q8_0, in torch, byte-compatible with the file format.

A quantized [N, K] tensor is stored row by row, each row K/32 blocks of 32 weights:
    Q4_0: d fp16 (2 bytes) | 16 bytes of nibbles             w = d * (q - 8)        18 bytes / block
    Q4_1: d fp16 | m fp16  | 16 bytes of nibbles             w = d * q + m          20 bytes / block
    Q8_0: d fp16 | 32 int8                                   w = d * q              34 bytes / block
Nibble order (as ggml and `gguf.quants`): byte j holds weight j in its low nibble and weight j + 16
in its high nibble. Decoding in float32 reproduces `gguf.quants.dequantize` bit for bit; the encoders
are ggml's reference round-to-nearest quantizers (as `gguf.quants.quantize`).
Other GGML types decode through the `gguf` package (`dequantize_any`). `GGUFWeight` is one such matrix
as a checkpoint hands it over (the loaders make them; kiln.ops.gemm.weight_formats prepares them).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    if qweight.numel() == 0 and qtype in KERNEL_QTYPES:  # torch cannot reinterpret empty byte views
        K = qweight.shape[1] // BLOCK_BYTES[qtype] * BLOCK_SIZE
        return torch.empty(qweight.shape[0], K, dtype=dtype, device=qweight.device)
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
    if N == 0 and qtype in KERNEL_QTYPES:
        return torch.empty(0, K // BLOCK_SIZE * BLOCK_BYTES[qtype], dtype=torch.uint8, device=weight.device)
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


@dataclass
class GGUFWeight:
    """A [out_features, in_features] matrix stored as GGUF blocks.

    qtype: "Q4_0" | "Q4_1" | "Q8_0"; data: uint8 [out_features, in_features / 32 * block_bytes].
    """

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [out_features, in_features] (exact: fp16 scales times small integers)."""
        n, k = self.shape
        blocks = self.data.view(n, k // BLOCK_SIZE, BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [n, nb, 1]
        # One float32 buffer, filled and scaled in place: load time is dominated by these passes.
        q = torch.empty(blocks.shape[:2] + (BLOCK_SIZE,), dtype=torch.float32)
        if self.qtype == "Q8_0":
            q.copy_(blocks[..., 2:].contiguous().view(torch.int8))
            return q.mul_(d).view(n, k).to(dtype)
        qs = blocks[..., -16:]
        q[..., :16] = qs & 0x0F  # low nibbles: weights 0..15 of the block
        q[..., 16:] = qs >> 4  # high nibbles: weights 16..31
        if self.qtype == "Q4_0":
            return q.sub_(8.0).mul_(d).view(n, k).to(dtype)
        m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
        return q.mul_(d).add_(m).view(n, k).to(dtype)

    def nibbles(self) -> torch.Tensor:
        """Q4_0 / Q4_1 quants as int32 [out_features, in_features] in 0..15: byte j of a block holds
        weight j in its low nibble and weight j + 16 in its high nibble."""
        n, k = self.shape
        nb = k // BLOCK_SIZE
        qs = self.data.view(n, nb, BLOCK_BYTES[self.qtype])[..., -16:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k).to(torch.int32)

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-block (d, m) float32 [out_features, in_features / 32] with weight = d * q + m (q in 0..15)."""
        n, k = self.shape
        blocks = self.data.view(n, k // BLOCK_SIZE, BLOCK_BYTES[self.qtype])
        d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32).squeeze(-1)
        if self.qtype == "Q4_0":
            return d, -8.0 * d
        m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32).squeeze(-1)
        return d, m

    def as_q4_1(self) -> GGUFWeight:
        """The same matrix as Q4_1 blocks (a Q4_0 block is d * (q - 8): Q4_1 with m = -8d, exact in fp16)."""
        if self.qtype != "Q4_0":
            return self
        n, k = self.shape
        blocks = self.data.view(n, k // BLOCK_SIZE, BLOCK_BYTES["Q4_0"])
        d = blocks[..., 0:2].contiguous().view(torch.float16)
        m = (d.to(torch.float32) * -8.0).to(torch.float16).view(torch.uint8)
        data = torch.cat([blocks[..., 0:2], m, blocks[..., 2:]], dim=-1).reshape(n, -1)
        return GGUFWeight("Q4_1", data, self.shape)

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The matrix with its output rows reordered by `index` (blocks never straddle rows)."""
        return GGUFWeight(self.qtype, self.data[index].contiguous(), (int(index.numel()), self.shape[1]))
