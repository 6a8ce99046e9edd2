"""What the JAX backends of the quantized GEMMs share: the weight formats decoded in jax.numpy (the
same layouts as kiln.quant.{int4,sparse24,gguf_blocks}), torch dtype arguments as jnp dtypes, and the
W8A8 scale epilogue.

    unpack_int4(qweight int32 [N, W], K) -> int32 [N, K] in 0..15 (nibble i of word j is weight 8j + i)
    dequantize_int4(...) -> float32 [N, K] = (q - zero) * scale per group
    decompress_24(values [N, K/2], meta uint8 [N, ceil(K/8)]) -> [N, K] in values' dtype (exact)
    dequantize_gguf(qweight uint8 [N, row_bytes], qtype) -> float32 [N, K], the same float32 operations
    as kiln.quant.gguf_blocks (so bit-exact with `gguf.quants.dequantize`)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kiln.ops.checks import dtype_name
from kiln.quant.gguf_blocks import BLOCK_BYTES, K_QUANTS


def jnp_dtype(dtype):
    """A torch dtype (as the torch bridge passes ScalarType arguments) or a jnp dtype -> the jnp dtype."""
    return jnp.dtype(dtype_name(dtype))


def scaled_epilogue(acc, x_scale, w_scale, bias, out_dtype):
    """float32 acc [M, N] * x_scale ([M, 1] or [1]) * w_scale ([N, 1] or [1]) (+ bias [N]) -> out_dtype."""
    out = acc * x_scale.astype(jnp.float32).reshape(-1, 1) * w_scale.astype(jnp.float32).reshape(1, -1)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(jnp_dtype(out_dtype))


# ---- int4 (GPTQ-style nibbles along K) -------------------------------------------------------------


def unpack_int4(qweight, K: int):
    """int32 [N, W] -> int32 [N, K] values 0..15 (the arithmetic shift of nibble 7 is masked off)."""
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32)
    nibbles = (qweight[:, :, None] >> shifts) & 0xF
    return nibbles.reshape(qweight.shape[0], -1)[:, :K]


def dequantize_int4(qweight, scales, zeros, group_size: int, K: int):
    """Packed int4 + per-group scales [N, G] / zero points uint8 [N, G] -> float32 [N, K]."""
    q = unpack_int4(qweight, K).astype(jnp.float32)
    s = jnp.repeat(scales.astype(jnp.float32), group_size, axis=1)[:, :K]
    z = jnp.repeat(zeros.astype(jnp.float32), group_size, axis=1)[:, :K]
    return (q - z) * s


# ---- 2:4 sparse -------------------------------------------------------------------------------------


def decompress_24(values, meta):
    """values [N, K/2], meta uint8 [N, ceil(K/8)] -> dense [N, K] in values' dtype."""
    n, half = values.shape
    groups = half // 2
    meta = meta.astype(jnp.int32)
    nibbles = jnp.stack([meta & 0xF, meta >> 4], axis=2).reshape(n, -1)[:, :groups]  # [N, G]
    idx = jnp.stack([nibbles & 3, nibbles >> 2], axis=2)  # [N, G, 2] kept positions
    kept = values.reshape(n, groups, 2)
    slots = jnp.arange(4, dtype=jnp.int32)
    hit = idx[..., None] == slots  # [N, G, 2, 4]
    dense = jnp.sum(jnp.where(hit, kept[..., None], jnp.zeros((), values.dtype)), axis=2)
    return dense.reshape(n, 4 * groups)


# ---- GGUF blocks ------------------------------------------------------------------------------------


def _half(two_bytes):
    """[..., 2] little-endian uint8 -> float32 [...] (the fp16 value)."""
    bits = two_bytes[..., 0].astype(jnp.uint16) | (two_bytes[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _nibbles(qs):
    """[..., 16] bytes -> [..., 32] values 0..15 (low nibbles are weights 0..15)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(packed, width: int):
    """uint8 [..., n] -> [..., 8 / width, n]: field t of every byte."""
    shifts = jnp.arange(0, 8, width, dtype=jnp.uint8)
    return (packed[..., None, :] >> shifts[:, None]) & ((1 << width) - 1)


def _k4_scales_mins(scales):
    a, b, c = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    m = jnp.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _dequantize_k(blocks, qtype: str):
    n, nb = blocks.shape[:2]
    if qtype == "Q6_K":
        low = _bits(blocks[..., 0:128].reshape(n, nb, 2, 64), 4)
        high = _bits(blocks[..., 128:192].reshape(n, nb, 2, 32), 2)
        q = (low.reshape(n, nb, 256) | (high.reshape(n, nb, 256) << 4)).astype(jnp.int32) - 32
        sc = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
        d = _half(blocks[..., 208:210])[..., None] * sc
        return (d[..., None] * q.reshape(n, nb, 16, 16).astype(jnp.float32)).reshape(n, nb, 256)
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, m = _k4_scales_mins(blocks[..., 4:16])
    q = _bits(blocks[..., -128:].reshape(n, nb, 4, 32), 4).reshape(n, nb, 8, 32)
    if qtype == "Q5_K":
        q = q | (_bits(blocks[..., 16:48], 1) << 4)
    scale = (d[..., None] * sc.astype(jnp.float32))[..., None]
    offset = (dmin[..., None] * m.astype(jnp.float32))[..., None]
    return (scale * q.astype(jnp.float32) - offset).reshape(n, nb, 256)


def dequantize_gguf(qweight, qtype: str):
    """uint8 [N, row_bytes] of `qtype` blocks (one of gguf_blocks.KERNEL_QTYPES) -> float32 [N, K]."""
    n = qweight.shape[0]
    blocks = qweight.reshape(n, -1, BLOCK_BYTES[qtype])
    if qtype in K_QUANTS:
        return _dequantize_k(blocks, qtype).reshape(n, -1)
    d = _half(blocks[..., 0:2])[..., None]
    if qtype == "Q8_0":
        w = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32) * d
    elif qtype == "Q4_0":
        w = (_nibbles(blocks[..., 2:]).astype(jnp.int32) - 8).astype(jnp.float32) * d
    elif qtype == "Q5_0":
        high = jnp.swapaxes(_bits(blocks[..., 2:6], 1), -1, -2).reshape(*blocks.shape[:2], 32)
        q = (_nibbles(blocks[..., 6:]) | (high << 4)).astype(jnp.int32) - 16
        w = q.astype(jnp.float32) * d
    else:  # Q4_1
        m = _half(blocks[..., 2:4])[..., None]
        w = d * _nibbles(blocks[..., 4:]).astype(jnp.float32) + m
    return w.reshape(n, -1)
