"""GGUF (ggml) block codecs in torch, byte-compatible with the file format.

A quantized [N, K] tensor is stored row by row, each row K / QK blocks of QK weights (QK = 32, or
256 for the K-quants' super-blocks); fp16 values are little-endian, offsets in bytes:
    Q4_0: d | 16 bytes of nibbles                           w = d * (q - 8)              18 B / 32
    Q4_1: d | m | 16 bytes of nibbles                       w = d * q + m                20 B / 32
    Q5_0: d | qh uint32 (bit j: bit 4 of q_j) | 16 nibbles  w = d * (q - 16)             22 B / 32
    Q8_0: d | 32 int8                                       w = d * q                    34 B / 32
    Q4_K: d | dmin | 12 bytes of 6-bit (sc, m) x 8 | 128 nibbles
          8 sub-blocks of 32:                               w = (d * sc) * q - dmin * m  144 B / 256
    Q5_K: as Q4_K, then 32 bytes qh (bit s of byte j: bit 4 of weight j of sub-block s), then the
          128 bytes of low nibbles                          (q in 0..31)                 176 B / 256
    Q6_K: 128 bytes low nibbles | 64 bytes 2-bit highs | 16 int8 scales | d
          16 sub-blocks of 16:                              w = (d * sc) * (q - 32)      210 B / 256
Nibble order (as ggml and `gguf.quants`): in the 32-blocks byte j holds weight j (low nibble) and
j + 16 (high); a K-quant's 32 bytes c of nibbles hold sub-block 2c (low) and 2c + 1 (high). Q4_K's
(sc, m) of sub-block s < 4 are the low 6 bits of bytes s and s + 4; of s >= 4, the nibbles of byte
s + 4 with bits 6-7 of bytes s - 4 and s as their top bits. Q6_K: weight 128h + 64t + i has its low
nibble in byte 64h + i (t = 0 low, 1 high), weight 128h + 32u + i its top 2 bits at bit 2u of byte
128 + 32h + i.
Decoding in float32 reproduces `gguf.quants.dequantize` bit for bit (each product of an fp16 scale and
small integers is exact; Q4_1 / Q4_K round once, as ggml). The encoders: Q4_0 / Q4_1 / Q5_0 / Q8_0 are
ggml's reference round-to-nearest quantizers (as `gguf.quants.quantize`); the gguf package has no
K-quant encoder, so Q4_K / Q5_K / Q6_K are encoded here by plain round-to-nearest (min/max scales per
sub-block, no search as llama.cpp's quantize does): valid blocks, a little less accurate than llama.cpp's.
Other GGML types decode through the `gguf` package (`dequantize_any`). `GGUFWeight` is one such matrix
as a checkpoint hands it over (the loaders make them; kiln.ops.gemm.weight_formats prepares them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK_SIZE = 32  # weights per block of the 32-block types (Q4_0, Q4_1, Q5_0, Q8_0)
QK_K = 256  # weights per K-quant super-block
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": QK_K, "Q5_K": QK_K, "Q6_K": QK_K}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
KERNEL_QTYPES = tuple(BLOCK_BYTES)
# GGML's type ids (what Kiln's native ops take for a block type)
GGML_TYPE_IDS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def block_weights(qtype: str) -> int:
    """Weights per block of `qtype` (32; 256 for the K-quants): K must be a multiple of it."""
    return BLOCK_WEIGHTS[qtype]


def row_bytes(qtype: str, K: int) -> int:
    """Bytes of one quantized row of K weights (K a multiple of block_weights(qtype))."""
    return K // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]


def _blocks(qweight: torch.Tensor, qtype: str) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, K / QK, block_bytes]."""
    return qweight.reshape(qweight.shape[0], -1, BLOCK_BYTES[qtype])


def _half(bytes2: torch.Tensor) -> torch.Tensor:
    """[..., 2n] little-endian bytes -> fp16 values [..., n]."""
    return bytes2.contiguous().view(torch.float16)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes -> [..., 32] values 0..15 (low nibbles are weights 0..15)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., n] -> [..., 8 / width, n]: field t of every byte (bits t*width .. (t+1)*width - 1)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(-2) >> shifts[:, None]) & ((1 << width) - 1)


def _k4_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8], 6 bits each."""
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([a & 63, (c & 0x0F) | ((a >> 6) << 4)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return sc, m


# w = (q - QUANT_OFFSET) * scale + min per weight, in float32 as ggml: the scale is d (or d * sc for the
# K-quants, a product ggml forms first and exact in float32), per scale_group weights (16 for Q6_K, 32
# otherwise); the min m (Q4_1) or -(dmin * m) (Q4_K, Q5_K) per 32; q * scale is exact too, so the one
# rounding is the add, as ggml's.
QUANT_OFFSET = {"Q4_0": 8, "Q5_0": 16, "Q6_K": 32}
SCALE_GROUP = {"Q6_K": 16}
WITH_MINS = ("Q4_1", "Q4_K", "Q5_K")
# fp16 values per super-block in block_codes' supers: (d, dmin) for Q4_K / Q5_K, d for Q6_K
SUPER_VALUES = {"Q4_K": 2, "Q5_K": 2, "Q6_K": 1}


def scale_group(qtype: str) -> int:
    """Weights per scale of `qtype`'s block_fields: 16 for Q6_K, else 32."""
    return SCALE_GROUP.get(qtype, 32)


def block_codes(
    qweight: torch.Tensor, qtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """uint8 [N, row_bytes] of KERNEL_QTYPES blocks -> the values the file stores, unmultiplied:
    (q int16 [N, K]: the stored quant, signed for Q8_0, else unsigned with its high bits;
     scales [N, K / scale_group]: float16 d, or the K-quants' sub-block sc (uint8; int8 for Q6_K);
     mins [N, K / 32]: float16 m (Q4_1), uint8 m (Q4_K, Q5_K), else None;
     supers float16 [N, K / 256 * SUPER_VALUES]: each super-block's (d, dmin) (Q4_K, Q5_K) or d
     (Q6_K), else None).
    group_scales turns them into block_fields' float32 scales and mins."""
    blocks = _blocks(qweight, qtype)
    n, nb = blocks.shape[:2]
    mins = supers = None
    if qtype == "Q6_K":
        low = _bits(blocks[..., 0:128].reshape(n, nb, 2, 64), 4)  # [n, nb, 2 halves, 2, 64]
        high = _bits(blocks[..., 128:192].reshape(n, nb, 2, 32), 2)  # [n, nb, 2 halves, 4, 32]
        q = low.reshape(n, nb, 256).short() | (high.reshape(n, nb, 256).short() << 4)
        scales, supers = blocks[..., 192:208].contiguous().view(torch.int8), _half(blocks[..., 208:210])
    elif qtype in K_QUANTS:  # Q4_K, Q5_K
        scales, mins = _k4_scales_mins(blocks[..., 4:16])
        supers = _half(blocks[..., 0:4])  # d, dmin
        # chunk c of the nibbles: sub-blocks 2c (low nibbles), 2c + 1 (high)
        q = _bits(blocks[..., -128:].reshape(n, nb, 4, 32), 4).reshape(n, nb, 256).short()
        if qtype == "Q5_K":  # bit s of byte j: sub-block s, weight j
            q = q | (_bits(blocks[..., 16:48], 1).reshape(n, nb, 256).short() << 4)
    else:
        scales = _half(blocks[..., 0:2])
        if qtype == "Q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).short()
        elif qtype == "Q4_0":
            q = _nibbles(blocks[..., 2:]).short()
        elif qtype == "Q5_0":  # bit 4 of q_j: bit j % 8 of byte j // 8
            high = _bits(blocks[..., 2:6], 1).transpose(-1, -2).reshape(n, nb, 32)
            q = (_nibbles(blocks[..., 6:]) | (high << 4)).short()
        else:  # Q4_1
            q = _nibbles(blocks[..., 4:]).short()
            mins = _half(blocks[..., 2:4])
    return tuple(None if t is None else t.reshape(n, -1) for t in (q, scales, mins, supers))


def group_scales(
    scales: torch.Tensor, mins: torch.Tensor | None, supers: torch.Tensor | None, qtype: str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """block_codes' (scales, mins, supers) [N, ...] -> float32 (scales [N, K / scale_group], mins
    [N, K / 32] or None): d, or d * sc and -(dmin * m) for the K-quants, the products ggml forms."""
    n = scales.shape[0]
    if supers is None:
        return scales.float(), None if mins is None else mins.float()
    values = supers.float().reshape(n, -1, SUPER_VALUES[qtype])
    product = values[..., :1] * scales.float().reshape(n, values.shape[1], -1)
    if mins is not None:
        mins = -(values[..., 1:] * mins.float().reshape(n, values.shape[1], -1)).reshape(n, -1)
    return product.reshape(n, -1), mins


def block_fields(qweight: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """uint8 [N, row_bytes] of KERNEL_QTYPES blocks -> (q int16 [N, K]: the stored quant, signed for
    Q8_0, else unsigned with its high bits; scales float32 [N, K / scale_group]; mins float32
    [N, K / 32], or None for the types without one), with w = (q - QUANT_OFFSET) * scale + min."""
    q, scales, mins, supers = block_codes(qweight, qtype)
    return q, *group_scales(scales, mins, supers, qtype)


def decode_fields(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, qtype: str, dtype: torch.dtype
) -> torch.Tensor:
    """block_fields (or the same fields kept elsewhere) -> the [N, K] matrix in `dtype`, computed in
    float32 (float64 when asked for it; exact there)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    n = q.shape[0]
    w = (q - QUANT_OFFSET.get(qtype, 0)).to(compute).reshape(n, scales.shape[1], -1)
    w = w * scales.to(compute)[..., None]
    if mins is not None:
        w = w.reshape(n, mins.shape[1], -1) + mins.to(compute)[..., None]
    return w.reshape(n, -1).to(dtype)


def dequantize_blocks(qweight: torch.Tensor, qtype: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [N, row_bytes] -> [N, K] in `dtype`. Computed in float32 (float64 when asked for it),
    the same operations as ggml, so float32 output is bit-exact with `gguf.quants.dequantize`."""
    if qtype not in KERNEL_QTYPES:
        raise ValueError(f"dequantize_blocks: qtype {qtype!r} unsupported, expected one of {KERNEL_QTYPES}")
    if qweight.numel() == 0:  # torch cannot reinterpret empty byte views
        K = qweight.shape[1] // BLOCK_BYTES[qtype] * BLOCK_WEIGHTS[qtype]
        return torch.empty(qweight.shape[0], K, dtype=dtype, device=qweight.device)
    return decode_fields(*block_fields(qweight, qtype), qtype, dtype)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def _pack_bits(fields: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 [..., 8 / width, n] fields -> [..., n] bytes, field t at bits t*width (inverse of _bits)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=fields.device)
    return (fields << shifts[:, None]).sum(dim=-2, dtype=torch.uint8)


def _safe_inverse(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v == 0, torch.zeros_like(v), 1 / torch.where(v == 0, torch.ones_like(v), v))


def _quantize_k(x: torch.Tensor, qtype: str) -> list[torch.Tensor]:
    """float32 super-blocks [N, nb, 256] -> the byte fields of `qtype`, in block order."""
    n, nb = x.shape[:2]
    if qtype == "Q6_K":
        sub = x.reshape(n, nb, 16, 16)
        imax = sub.abs().argmax(-1, keepdim=True)
        scale = torch.gather(sub, -1, imax).squeeze(-1) / -32  # the signed extreme maps to q = 0
        d = (scale.abs().amax(-1, keepdim=True) / 127).half()
        sc = _round_half_away(scale * _safe_inverse(d.float())).clamp(-127, 127)
        step = (d.float() * sc)[..., None]
        q = _round_half_away(sub * _safe_inverse(step)).clamp(-32, 31) + 32
        q = q.to(torch.uint8).reshape(n, nb, 256)
        low = _pack_bits((q & 0x0F).reshape(n, nb, 2, 2, 64), 4).reshape(n, nb, 128)
        high = _pack_bits((q >> 4).reshape(n, nb, 2, 4, 32), 2).reshape(n, nb, 64)
        return [low, high, sc.to(torch.int8).view(torch.uint8), d.view(torch.uint8)]
    qmax = 31 if qtype == "Q5_K" else 15
    sub = x.reshape(n, nb, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)
    scale, mins = (sub.amax(-1) - lo) / qmax, -lo
    d = (scale.amax(-1, keepdim=True) / 63).half()
    dmin = (mins.amax(-1, keepdim=True) / 63).half()
    sc = _round_half_away(scale * _safe_inverse(d.float())).clamp(0, 63).to(torch.uint8)
    m = _round_half_away(mins * _safe_inverse(dmin.float())).clamp(0, 63).to(torch.uint8)
    step = (d.float() * sc)[..., None]
    offset = (dmin.float() * m)[..., None]
    q = _round_half_away((sub + offset) * _safe_inverse(step)).clamp(0, qmax).to(torch.uint8)
    scales = torch.cat(
        [sc[..., :4] | ((sc[..., 4:] >> 4) << 6), m[..., :4] | ((m[..., 4:] >> 4) << 6),
         (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], dim=-1,
    )  # fmt: skip
    nibbles = _pack_bits((q & 0x0F).reshape(n, nb, 4, 2, 32), 4).reshape(n, nb, 128)
    parts = [d.view(torch.uint8), dmin.view(torch.uint8), scales]
    if qtype == "Q5_K":
        parts.append(_pack_bits(q >> 4, 1))  # [n, nb, 8 sub-blocks, 32] -> 32 bytes
    return parts + [nibbles]


def quantize_blocks(weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """float [N, K] (K a multiple of block_weights(qtype)) -> uint8 [N, row_bytes] in the GGUF layout."""
    N, K = weight.shape
    if qtype not in KERNEL_QTYPES:
        raise ValueError(f"quantize_blocks: qtype {qtype!r} unsupported, expected one of {KERNEL_QTYPES}")
    qk = BLOCK_WEIGHTS[qtype]
    if K % qk:
        raise ValueError(f"quantize_blocks: K={K} must be a multiple of {qk} for GGUF {qtype} blocks")
    if N == 0:
        return torch.empty(0, K // qk * BLOCK_BYTES[qtype], dtype=torch.uint8, device=weight.device)
    x = weight.detach().to(device="cpu", dtype=torch.float32).reshape(N, K // qk, qk)
    if qtype in K_QUANTS:
        parts = _quantize_k(x, qtype)
    elif qtype == "Q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
        parts = [d.half().view(torch.uint8), q]
    elif qtype in ("Q4_0", "Q5_0"):
        half_range = 8 if qtype == "Q4_0" else 16
        imax = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, imax) / -half_range  # the signed extreme maps to q = 0
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(x * inv + (half_range + 0.5)).clamp(0, 2 * half_range - 1).to(torch.uint8)
        nibbles = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)
        parts = [d.half().view(torch.uint8), nibbles]
        if qtype == "Q5_0":  # bit 4 of q_j at bit j % 8 of byte j // 8
            parts.insert(1, _pack_bits((q >> 4).reshape(N, -1, 4, 8).transpose(-1, -2), 1))
    else:  # Q4_1
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
        parts = [d.half().view(torch.uint8), lo.half().view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
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

    qtype: one of KERNEL_QTYPES; data: uint8 [out_features, row_bytes(qtype, in_features)].
    """

    qtype: str
    data: torch.Tensor
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [out_features, in_features] (as `gguf.quants.dequantize`, then `dtype`)."""
        n, k = self.shape
        if self.qtype not in ("Q4_0", "Q4_1", "Q8_0"):
            return dequantize_blocks(self.data.view(n, -1), self.qtype, torch.float32).to(dtype)
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
        """Q4_0 / Q4_1 / Q4_K quants as int32 [out_features, in_features] in 0..15: byte j of a block
        holds weight j in its low nibble and weight j + 16 in its high nibble (Q4_K: the module
        docstring's order)."""
        n, k = self.shape
        if self.qtype == "Q4_K":
            qs = self.data.view(n, k // QK_K, BLOCK_BYTES["Q4_K"])[..., 16:].reshape(n, -1, 4, 32)
            return _bits(qs, 4).reshape(n, k).to(torch.int32)
        nb = k // BLOCK_SIZE
        qs = self.data.view(n, nb, BLOCK_BYTES[self.qtype])[..., -16:]
        return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k).to(torch.int32)

    def scales_and_mins(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-32-weight (d, m) float32 [out_features, in_features / 32] with weight = d * q + m (q in
        0..15): Q4_0, Q4_1, and Q4_K's sub-blocks (d = d * sc, m = -dmin * m, both exact in float32)."""
        n, k = self.shape
        if self.qtype == "Q4_K":
            blocks = self.data.view(n, k // QK_K, BLOCK_BYTES["Q4_K"])
            d, dmin = _half(blocks[..., 0:2]).float(), _half(blocks[..., 2:4]).float()
            sc, m = _k4_scales_mins(blocks[..., 4:16])
            return (d * sc.float()).reshape(n, -1), (-(dmin * m.float())).reshape(n, -1)
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

    def as_q8_0(self) -> GGUFWeight:
        """The same matrix as Q8_0 blocks: a Q4_0 / Q5_0 block is d * (q - offset) with q - offset in
        -16..15, a Q8_0 block's int8 values under the same float16 d, exact (so a fused projection
        whose parts mix these types stays blocks). Other types: ValueError."""
        if self.qtype == "Q8_0":
            return self
        if self.qtype not in ("Q4_0", "Q5_0"):
            raise ValueError(f"GGUFWeight.as_q8_0: GGUF {self.qtype} has no exact Q8_0 form")
        n, k = self.shape
        q, d, _, _ = block_codes(self.data.view(n, -1), self.qtype)
        values = (q - QUANT_OFFSET[self.qtype]).to(torch.int8).view(n, k // BLOCK_SIZE, BLOCK_SIZE)
        d = d.reshape(n, k // BLOCK_SIZE, 1).contiguous().view(torch.uint8)  # float16 d as its 2 bytes
        data = torch.cat([d, values.view(torch.uint8)], dim=-1).reshape(n, -1)
        return GGUFWeight("Q8_0", data, self.shape)

    @property
    def block_weights(self) -> int:
        """Weights per block (32, or 256 for the K-quants): column slices must fall on multiples of it."""
        return BLOCK_WEIGHTS[self.qtype]

    def rows(self, index: torch.Tensor) -> GGUFWeight:
        """The matrix with its output rows reordered by `index` (blocks never straddle rows)."""
        return GGUFWeight(self.qtype, self.data[index].contiguous(), (int(index.numel()), self.shape[1]))


@dataclass
class GGUFStackedWeight:
    """GGUF matrices of different block types stacked along the output dim: a fused projection of a file
    that mixes types where no one GGUF type holds every part exactly (a Q4_K_M file's Q4_K q / k
    beside a Q6_K v in the layers llama.cpp gives more bits; kiln.models.weights.cat_rows). The parts
    keep their blocks; `fields` gives them one exact form, int8 values with a float32 scale and min per
    block of 16 or 32 weights, which the CPU's blocks kernels read (kiln.ops.gemm.weight_formats).

    parts: GGUFWeights of KERNEL_QTYPES with the same in_features; shape: (sum of their rows, K).
    """

    parts: tuple[GGUFWeight, ...]
    shape: tuple[int, int]

    @classmethod
    def stack(cls, parts: list[GGUFWeight]) -> GGUFStackedWeight:
        """The parts stacked; ValueError for a type without a block decoder here or different K."""
        bad = [p.qtype for p in parts if p.qtype not in KERNEL_QTYPES]
        if bad or len({p.shape[1] for p in parts}) != 1:
            raise ValueError(
                f"GGUFStackedWeight: parts must be GGUF {KERNEL_QTYPES} matrices with one in_features, got "
                + ", ".join(f"{p.qtype} {tuple(p.shape)}" for p in parts)
            )
        return cls(tuple(parts), (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    @property
    def qtypes(self) -> tuple[str, ...]:
        """The parts' GGUF types, each once, in order of the parts."""
        return tuple(dict.fromkeys(p.qtype for p in self.parts))

    @property
    def block(self) -> int:
        """Weights per scale in `fields`: 16 where a part scales per 16 (Q6_K), else 32."""
        return min(scale_group(q) for q in self.qtypes)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [N, K]: each part as `GGUFWeight.dequantize` decodes it, then `dtype`."""
        return torch.cat([p.dequantize(torch.float32) for p in self.parts]).to(dtype)

    def fields(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values int8 [N, K], scales float32 [N, K / B], mins float32 [N, K / B] or None where no part
        has mins), B = `block`, with w = values * scale + min exactly each part's decoded weight: the
        stored quant less its offset, ggml's own float32 scale and min products, repeated for each
        block of 16 in a block of 32 (the same floats, so the same float32 rounding of w)."""
        block = self.block
        with_mins = any(q in WITH_MINS for q in self.qtypes)
        values, scales, mins = [], [], []
        for part in self.parts:
            n = part.shape[0]
            q, scale, minimum = block_fields(part.data.view(n, -1), part.qtype)
            values.append((q - QUANT_OFFSET.get(part.qtype, 0)).to(torch.int8))
            scales.append(scale.repeat_interleave(scale_group(part.qtype) // block, dim=1))
            if with_mins:  # block_fields' mins are per 32
                k_blocks = part.shape[1] // block
                zero = torch.zeros(n, k_blocks, dtype=torch.float32)
                mins.append(
                    zero if minimum is None else minimum.repeat_interleave(BLOCK_SIZE // block, dim=1)
                )
        return torch.cat(values), torch.cat(scales), torch.cat(mins) if with_mins else None
