"""Triton device functions that read GGUF Q4_0 / Q4_1 / Q8_0 weights straight from the file's uint8
blocks (the layout: ../gguf_blocks.py and kiln.quant.gguf_blocks); gguf_dequantize's and
gguf_linear's kernels call them.

`dequantize_at(row_ptr, k, mask, QTYPE)` turns raw bytes into float32 weights for any broadcast shape
of (row base pointer, k index): block k // 32 of the row starts at byte (k // 32) * BLOCK_BYTES; its
fp16 scale is two little-endian bytes reassembled and bitcast (`fp16_at`); weight j of the block is
byte 2 + j (Q8_0, as int8) or the low (j < 16) / high (j >= 16) nibble of byte 2 + j % 16 (Q4_0;
Q4_1 after its fp16 min).
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
def dequantize_at(row_ptr, k, mask, QTYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr):
    """float32 weights at column k of the rows starting at row_ptr (broadcast shapes); 0 where masked."""
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
    else:  # Q4_1
        m = fp16_at(block + 2, mask)
        byte = tl.load(block + 4 + (j % 16), mask=mask, other=0)
        q = (byte >> ((j // 16) * 4).to(tl.uint8)) & 0xF
        w = d * q.to(tl.float32) + m
    return w
