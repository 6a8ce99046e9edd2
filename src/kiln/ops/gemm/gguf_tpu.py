"""The GGUF block decoder that the Mosaic TPU kernels of gguf_dequantize and gguf_linear share, and
the tiling of the raw block bytes for them.

A kernel step owns 128 output rows and `blocks` whole blocks of each (a K tile of blocks * QK
weights, QK = 32 or 256). It receives the rows' raw bytes, uint8 [128, tile_bytes], decodes them in
VMEM to float32 [blocks * QK, 128] (W^T: row k is weight k of the K tile), and the op's kernel either
multiplies x by that tile or transposes it out.

Why not jax_codecs.dequantize_gguf inside the kernel: a block's fields sit at multiples of 18, 20, 22,
34, 144, 176 or 210 bytes along the lane axis, and the jnp decoder gathers them with reshapes to
[.., blocks, block_bytes], lane slices and concatenations, and reads fp16 through a 16-bit bitcast.
Mosaic has no lane gathers or such reshapes, and strided loads only along the second-minor axis of a
32-bit ref whose last dim is 128. So the kernel widens the byte tile to int32 and transposes it
(bytes on sublanes, the 128 rows on lanes) into a VMEM scratch; byte i of every block of the tile is
then one strided load `bytes[i::block_bytes]` -> int32 [blocks, 128], every weight position j of a
block is computed from such rows with shifts, masks and int -> float32 converts, and stored with a
strided store `decoded[j::QK] = plane`. fp16 scales are assembled from their bit fields in int32
(exact, subnormals included). The float32 operations and their order are jax_codecs' (so those of
kiln.quant.gguf_blocks and ggml): `d * q`, `d * q + m`, `(d * sc) * q - dmin * m`. The 32-block types'
32 positions are unrolled; the K-quants' 256 are a loop over the position within a sub-block.
Checked in the TPU interpreter and by lowering to Mosaic MLIR; Mosaic's own compilation (layouts,
the strided loads and stores, the transposes) needs a TPU and has not been run.

Tiles: 128 output rows (the strided ops need a 128-lane ref). A K tile holds `blocks_per_tile`
blocks: as many as make its bytes a multiple of 128 (64 for Q4_0 / Q5_0 / Q8_0, 32 for Q4_1, 8 for
Q4_K / Q5_K; 2048 or 1024 weights), so aligned weights cross HBM untouched; Q6_K's 210-byte blocks
would need 64 (16384 weights), so Q6_K uses 8 and each tile's 1680 bytes are padded to 1792. Short
rows use fewer blocks (for the legacy types a multiple of 4, so the decoded tile is 128-row aligned).
Rows are padded to 128 and blocks to whole tiles with zero bytes: a zero block decodes to zeros.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kiln.ops.pallas_common import LANES, pad_to, round_up
from kiln.quant.gguf_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, K_QUANTS

ROWS = LANES  # output rows per tile: the lane width of the transposed byte and decoded-weight tiles
MAX_TILE_WEIGHTS = 2048


def blocks_per_tile(qtype: str, blocks_per_row: int) -> int:
    """Blocks of one K tile for rows of `blocks_per_row` blocks (module docstring)."""
    qk = BLOCK_WEIGHTS[qtype]
    aligned = LANES // math.gcd(BLOCK_BYTES[qtype], LANES)  # fewest blocks whose bytes fill 128 lanes
    step = LANES // math.gcd(qk, LANES)  # decoded tile rows (blocks * qk) a multiple of 128
    return min(aligned, MAX_TILE_WEIGHTS // qk, round_up(max(blocks_per_row, 1), step))


def check_blocks_per_tile(op: str, qtype: str, blocks: int) -> None:
    """ValueError unless `blocks` blocks of `qtype` decode to a whole number of 128-row tiles."""
    step = LANES // math.gcd(BLOCK_WEIGHTS[qtype], LANES)
    if blocks <= 0 or blocks % step:
        raise ValueError(
            f"{op}: tile_blocks={blocks} for {qtype}, expected a positive multiple of {step} "
            "(the decoded K tile must be whole 128-row tiles)"
        )


def tile_bytes(qtype: str, blocks: int) -> int:
    """Bytes of one row of a K tile in VMEM: blocks * block bytes, rounded up to 128 lanes."""
    return round_up(blocks * BLOCK_BYTES[qtype], LANES)


def tiled_weight(qweight, qtype: str, blocks: int):
    """uint8 [N, row_bytes] -> uint8 [N_pad, tiles * tile_bytes]: N padded to 128 rows, the row's
    blocks to whole tiles of `blocks`, each tile's bytes to tile_bytes (zero bytes: zero blocks).
    A no-op when all of these already fit (no copy of the weight)."""
    n, row = qweight.shape
    block_bytes = BLOCK_BYTES[qtype]
    tiles = -(-(row // block_bytes) // blocks)
    raw, padded = blocks * block_bytes, tile_bytes(qtype, blocks)
    w = pad_to(qweight, 1, tiles * raw)
    if padded != raw:
        w = pad_to(w.reshape(n, tiles, raw), 2, padded).reshape(n, tiles * padded)
    return pad_to(w, 0, round_up(n, ROWS))


def half_to_float32(bits):
    """int32 fp16 bit patterns (0..65535) -> float32, exactly (subnormals, inf and NaN included)."""
    sign = (bits & 0x8000) << 16
    exponent = (bits >> 10) & 0x1F
    mantissa = bits & 0x3FF
    biased = jnp.where(exponent == 31, 0xFF, exponent + 112)  # fp16 bias 15 -> float32 bias 127
    normal = jax.lax.bitcast_convert_type(sign | (biased << 23) | (mantissa << 13), jnp.float32)
    tiny = mantissa.astype(jnp.float32) * 2.0**-24  # exact; built in float so TPUs cannot flush it
    tiny = jnp.where(sign != 0, -tiny, tiny)
    return jnp.where(exponent == 0, tiny, normal)


def _signed_byte(b):
    return b - ((b >> 7) << 8)


def _decode_legacy(byte, store, qtype: str) -> None:
    """Q4_0 / Q4_1 / Q5_0 / Q8_0: `byte(i)` int32 [blocks, 128] is byte i of every block; weight j
    goes to `store(j, float32 [blocks, 128])`."""
    d = half_to_float32(byte(0) | (byte(1) << 8))
    if qtype == "Q8_0":
        for j in range(32):
            store(j, _signed_byte(byte(2 + j)).astype(jnp.float32) * d)
        return
    first = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6}[qtype]
    m = half_to_float32(byte(2) | (byte(3) << 8)) if qtype == "Q4_1" else None
    high_bytes = [byte(2 + t) for t in range(4)] if qtype == "Q5_0" else None  # bit j: bit 4 of q_j
    for i in range(16):
        packed = byte(first + i)
        for j, q in ((i, packed & 0x0F), (i + 16, packed >> 4)):
            if qtype == "Q4_0":
                store(j, (q - 8).astype(jnp.float32) * d)
            elif qtype == "Q4_1":
                store(j, d * q.astype(jnp.float32) + m)
            else:
                q = q | (((high_bytes[j // 8] >> (j % 8)) & 1) << 4)
                store(j, (q - 16).astype(jnp.float32) * d)


def _over_positions(count: int, body) -> None:
    """body(i) for i in 0..count-1 as a loop (not unrolled: the K-quants' 256 weight positions would
    make a kernel body of thousands of ops to trace and compile)."""

    def step(i, carry):
        body(i)
        return carry

    jax.lax.fori_loop(0, count, step, 0)


def _decode_q4_q5_k(byte, store, qtype: str) -> None:
    """Q4_K / Q5_K super-blocks: 8 sub-blocks s of 32 weights, w = (d * sc_s) * q - dmin * m_s."""
    d = half_to_float32(byte(0) | (byte(1) << 8))
    dmin = half_to_float32(byte(2) | (byte(3) << 8))
    a, b, c = (
        [byte(4 + t) for t in range(4)],
        [byte(8 + t) for t in range(4)],
        [byte(12 + t) for t in range(4)],
    )
    sc = [x & 63 for x in a] + [(c[t] & 0x0F) | ((a[t] >> 6) << 4) for t in range(4)]
    mins = [x & 63 for x in b] + [(c[t] >> 4) | ((b[t] >> 6) << 4) for t in range(4)]
    scale = [d * s.astype(jnp.float32) for s in sc]
    offset = [dmin * m.astype(jnp.float32) for m in mins]
    first = 48 if qtype == "Q5_K" else 16  # the 128 bytes of nibbles: chunk c holds sub-blocks 2c, 2c+1

    def weight_i_of_every_sub_block(i):
        high = byte(16 + i) if qtype == "Q5_K" else None  # bit s: bit 4 of weight i of sub-block s
        for chunk in range(4):
            packed = byte(first + 32 * chunk + i)
            for s, q in ((2 * chunk, packed & 0x0F), (2 * chunk + 1, packed >> 4)):
                if high is not None:
                    q = q | (((high >> s) & 1) << 4)
                store(32 * s + i, scale[s] * q.astype(jnp.float32) - offset[s])

    _over_positions(32, weight_i_of_every_sub_block)


def _decode_q6_k(byte, store) -> None:
    """Q6_K: 16 sub-blocks of 16, w = (d * sc) * (q - 32); weight 128h + 32u + i (i < 32) has its low
    nibble in byte 64h + 32(u % 2) + i (bits 4(u // 2)), its top 2 bits in byte 128 + 32h + i (bits 2u)."""
    d = half_to_float32(byte(208) | (byte(209) << 8))
    scale = [d * _signed_byte(byte(192 + u)).astype(jnp.float32) for u in range(16)]
    for upper in range(2):  # i < 16 and i >= 16 lie in different sub-blocks: static scale choice

        def eight_weights(i_low, upper=upper):
            i = 16 * upper + i_low
            for h in range(2):
                low = (byte(64 * h + i), byte(64 * h + 32 + i))
                high = byte(128 + 32 * h + i)
                for u in range(4):
                    q = ((low[u % 2] >> (4 * (u // 2))) & 0x0F) | (((high >> (2 * u)) & 3) << 4)
                    sub_block = 8 * h + 2 * u + upper  # (128h + 32u + i) // 16
                    store(128 * h + 32 * u + i, scale[sub_block] * (q - 32).astype(jnp.float32))

        _over_positions(16, eight_weights)


def decode_tile(w_ref, bytes_ref, decoded_ref, qtype: str, blocks: int) -> None:
    """Inside a kernel: w_ref uint8 [128, tile_bytes] (128 rows of `blocks` blocks) -> decoded_ref
    float32 [blocks * QK, 128] = W^T of the tile. bytes_ref: int32 [tile_bytes, 128] VMEM scratch."""
    block_bytes, qk = BLOCK_BYTES[qtype], BLOCK_WEIGHTS[qtype]
    bytes_ref[...] = w_ref[...].astype(jnp.int32).T

    def byte(i: int):
        return bytes_ref[pl.ds(i, blocks, stride=block_bytes), :]

    def store(j: int, plane) -> None:
        decoded_ref[pl.ds(j, blocks, stride=qk), :] = plane

    if qtype == "Q6_K":
        _decode_q6_k(byte, store)
    elif qtype in K_QUANTS:
        _decode_q4_q5_k(byte, store, qtype)
    else:
        _decode_legacy(byte, store, qtype)
