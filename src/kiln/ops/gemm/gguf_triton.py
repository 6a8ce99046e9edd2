"""Triton device functions that read GGUF weights straight from the file's uint8 blocks (the layouts:
kiln.quant.gguf_blocks); gguf_dequantize's and gguf_linear's kernels call them.

`dequantize_at(row_ptr, k, mask, QTYPE, BLOCK_BYTES)` turns raw bytes into float32 weights for any
broadcast shape of (row base pointer, k index): block k // QK of the row starts at byte
(k // QK) * BLOCK_BYTES (QK = 32, 256 for the K-quants); fp16 scales are two little-endian bytes
reassembled and bitcast (`fp16_at`). In a 32-block, weight j is byte 2 + j (Q8_0, as int8) or the low
(j < 16) / high (j >= 16) nibble of byte j % 16 of the nibbles (Q4_0 / Q5_0 / Q4_1 after their
scale, high bits or min). K-quant super-blocks decode per weight too: its sub-block's 6-bit (sc, m) or
int8 scale is re-read for every weight (cheap: the bytes are in L1), then the same float32 products as
ggml, so results are bit-exact.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp16_at(ptr, mask):
    """The little-endian fp16 at byte pointers `ptr` (any shape), as float32; 0 where masked."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte_at(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _k4_scale_min_at(scales_ptr, sub, mask):
    """Q4_K / Q5_K: (sc, m) of sub-block `sub` (0..7) from the 12 packed scale bytes, as float32."""
    a = _byte_at(scales_ptr + sub, mask)  # sub < 4: sc's 6 bits; else m's top 2 bits (bits 6-7)
    b = _byte_at(scales_ptr + sub + 4, mask)  # sub < 4: m's 6 bits; else sc (low nibble), m (high)
    c = _byte_at(scales_ptr + (sub + 4) % 8, mask)  # sub >= 4: byte sub - 4, sc's top 2 bits
    low = sub < 4
    sc = tl.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    m = tl.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def _k_quant_at(block, j, mask, QTYPE: tl.constexpr):
    """Weight j (0..255) of the K-quant super-blocks at byte pointers `block`, as float32."""
    if QTYPE == "Q6_K":
        half = j // 128
        p = j % 128
        low = (_byte_at(block + half * 64 + p % 64, mask) >> ((p // 64) * 4)) & 0xF
        high = (_byte_at(block + 128 + half * 32 + p % 32, mask) >> ((p // 32) * 2)) & 3
        sc = tl.load(block + 192 + j // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = fp16_at(block + 208, mask)
        w = (d * sc) * ((low | (high << 4)) - 32).to(tl.float32)
    else:
        sub = j // 32
        i = j % 32
        d = fp16_at(block, mask)
        dmin = fp16_at(block + 2, mask)
        sc, m = _k4_scale_min_at(block + 4, sub, mask)
        nibbles = block + (48 if QTYPE == "Q5_K" else 16)
        q = (_byte_at(nibbles + (sub // 2) * 32 + i, mask) >> ((sub % 2) * 4)) & 0xF
        if QTYPE == "Q5_K":
            q = q | (((_byte_at(block + 16 + i, mask) >> sub) & 1) << 4)
        w = (d * sc) * q.to(tl.float32) - dmin * m
    return w


@triton.jit
def dequantize_at(row_ptr, k, mask, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """float32 weights at column k of the rows starting at row_ptr (broadcast shapes); 0 where masked."""
    if QTYPE == "Q4_K":
        w = _k_quant_at(row_ptr + (k // 256) * BLOCK_BYTES, k % 256, mask, QTYPE)
    elif QTYPE == "Q5_K":
        w = _k_quant_at(row_ptr + (k // 256) * BLOCK_BYTES, k % 256, mask, QTYPE)
    elif QTYPE == "Q6_K":
        w = _k_quant_at(row_ptr + (k // 256) * BLOCK_BYTES, k % 256, mask, QTYPE)
    else:
        block = row_ptr + (k // 32) * BLOCK_BYTES
        j = k % 32
        d = fp16_at(block, mask)
        if QTYPE == "Q8_0":
            q = tl.load(block + 2 + j, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            w = q * d
        elif QTYPE == "Q4_0":
            byte = tl.load(block + 2 + (j % 16), mask=mask, other=0)
            q = (byte >> ((j // 16) * 4).to(tl.uint8)) & 0xF
            w = (q.to(tl.int32) - 8).to(tl.float32) * d
        elif QTYPE == "Q5_0":
            low = (_byte_at(block + 6 + (j % 16), mask) >> ((j // 16) * 4)) & 0xF
            high = (_byte_at(block + 2 + j // 8, mask) >> (j % 8)) & 1
            w = ((low | (high << 4)) - 16).to(tl.float32) * d
        else:  # Q4_1
            m = fp16_at(block + 2, mask)
            byte = tl.load(block + 4 + (j % 16), mask=mask, other=0)
            q = (byte >> ((j // 16) * 4).to(tl.uint8)) & 0xF
            w = d * q.to(tl.float32) + m
    return w
