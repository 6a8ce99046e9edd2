"""The GGUF block decoder that the Pallas Triton (GPU) kernels of gguf_dequantize and gguf_linear share:
a [rows, columns] tile of W in float32, read straight from the file's uint8 blocks in the kernel.

    decode_weights(w_ref, rows int32 [BN, 1], cols int32 [1, BK], qtype) -> float32 [BN, BK]

Every byte a weight needs is a gather from the weight ref at (row, byte) index arrays of the tile's
shape (Triton loads through pointer tensors, so a gather is a plain load; the bytes of a tile sit in a
few cache lines per row). Weight k of a row lies in block k // QK (QK = 32, 256 for the K-quants) at
byte (k // QK) * block bytes; within the block the fields are those of kiln.quant.gguf_blocks and
../gguf_triton.py: fp16 scales are two little-endian bytes joined and bitcast, nibbles and high bits
are shifted out of their bytes, K-quant sub-block scales are re-read per weight.

The float32 operations and their order are jax_codecs' (so ggml's): `d * q`, `d * q + m`,
`(d * sc) * q - dmin * m`, `(d * sc) * (q - 32)`. Pallas Triton cannot turn off FMA contraction, but it
cannot change a result here: every product that feeds an add or subtract is exact in float32 (d and
dmin have 11 significant bits, q at most 5, sc and m 6; (d * sc) * q at most 22 bits), so a fused
multiply-add rounds the same single sum. Float32 output is therefore bit-exact with `gguf.quants`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, K_QUANTS

MAX_TILE_K = 128  # weights per decoded tile row (as the torch Triton kernel): four 32-blocks


def tile_k(qtype: str, k: int, most: int = MAX_TILE_K) -> int:
    """The K tile: the largest power of two <= `most` that divides K (K is whole blocks of 32 or 256
    weights, so the tile holds at least min(32, most) weights and never straddles the end of a row)."""
    tile = most
    while k % tile:
        tile //= 2
    return tile


def _signed(byte):
    """int32 0..255 -> the int8 it encodes, as int32."""
    return byte - ((byte >> 7) << 8)


def _half(low, high):
    """Two int32 bytes (little-endian fp16 bits) -> the fp16 value as float32 (exact)."""
    bits = (low | (high << 8)).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _k4_scale_min(byte, sub):
    """Q4_K / Q5_K: sub-block `sub`'s 6-bit (sc, m) from the 12 scale bytes at 4..15, as float32.
    sub < 4: sc = s[sub] & 63, m = s[sub + 4] & 63; else the low/high nibble of s[sub + 4] with the top
    two bits of s[sub - 4] (sc) and s[sub] (m)."""
    a = byte(4 + sub)
    b = byte(8 + sub)
    c = byte(4 + ((sub + 4) & 7))  # s[sub - 4] for sub >= 4 (unused below 4)
    low = sub < 4
    sc = jnp.where(low, a & 63, (b & 0xF) | ((c >> 6) << 4))
    m = jnp.where(low, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.astype(jnp.float32), m.astype(jnp.float32)


def _k_quant(byte, j, qtype: str):
    """Weight j (0..255) of each tile element's super-block, as float32."""
    if qtype == "Q6_K":
        half, p = j >> 7, j & 127
        low = (byte(64 * half + (p & 63)) >> (4 * (p >> 6))) & 0xF
        high = (byte(128 + 32 * half + (p & 31)) >> (2 * (p >> 5))) & 3
        sc = _signed(byte(192 + (j >> 4))).astype(jnp.float32)
        d = _half(byte(208), byte(209))
        return (d * sc) * ((low | (high << 4)) - 32).astype(jnp.float32)
    sub, i = j >> 5, j & 31
    d, dmin = _half(byte(0), byte(1)), _half(byte(2), byte(3))
    sc, m = _k4_scale_min(byte, sub)
    nibbles = 48 if qtype == "Q5_K" else 16
    q = (byte(nibbles + 32 * (sub >> 1) + i) >> (4 * (sub & 1))) & 0xF
    if qtype == "Q5_K":
        q = q | (((byte(16 + i) >> sub) & 1) << 4)
    return (d * sc) * q.astype(jnp.float32) - dmin * m


def _block_32(byte, j, qtype: str):
    """Weight j (0..31) of each tile element's 32-block (Q4_0 / Q4_1 / Q5_0 / Q8_0), as float32."""
    d = _half(byte(0), byte(1))
    if qtype == "Q8_0":
        return _signed(byte(2 + j)).astype(jnp.float32) * d
    nibble_shift = 4 * (j >> 4)  # weights 0..15: low nibbles of the 16 bytes, 16..31: high nibbles
    if qtype == "Q4_0":
        q = (byte(2 + (j & 15)) >> nibble_shift) & 0xF
        return (q - 8).astype(jnp.float32) * d
    if qtype == "Q5_0":
        low = (byte(6 + (j & 15)) >> nibble_shift) & 0xF
        high = (byte(2 + (j >> 3)) >> (j & 7)) & 1
        return ((low | (high << 4)) - 16).astype(jnp.float32) * d
    m = _half(byte(2), byte(3))  # Q4_1
    q = (byte(4 + (j & 15)) >> nibble_shift) & 0xF
    return d * q.astype(jnp.float32) + m


def decode_weights(w_ref, rows, cols, qtype: str):
    """Inside a Pallas Triton kernel: w_ref uint8 [N, row_bytes] of `qtype` blocks, rows int32 [BN, 1]
    (in range: clamp padding rows), cols int32 [1, BK] weight indices < K -> float32 [BN, BK] (powers
    of two, the Triton rule for the gathers)."""
    shape = (rows.shape[0], cols.shape[1])
    qk, block_bytes = BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype]
    rows = jnp.broadcast_to(rows, shape)
    block_start = jnp.broadcast_to(jax.lax.div(cols, jnp.int32(qk)) * block_bytes, shape)
    j = jnp.broadcast_to(cols & (qk - 1), shape)

    def byte(offset):
        """Byte `offset` (an int or an int32 tile) of every element's block, as int32."""
        return w_ref[rows, block_start + offset].astype(jnp.int32)

    return _k_quant(byte, j, qtype) if qtype in K_QUANTS else _block_32(byte, j, qtype)
