"""Triton kernel for write_kv_cache. One program owns one token: it reads the token's slot, and
unless the slot is negative (padding) copies its [num_kv_heads, head_dim] key and value rows into
the cache, quantizing to fp8 e4m3 with the per-kv-head scale when the cache is fp8."""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.registry import Implementation, triton_available


@triton.jit
def _round_to_e4m3(x):
    """float32 x with |x| <= 448 rounded to the nearest (ties to even) e4m3 value, still float32.

    The later cast is then exact, so the result does not depend on how the hardware (or the Triton
    interpreter, which truncates) rounds fp8 conversions. Normals keep 3 mantissa bits: round the
    float32 bit pattern at bit 20. Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: adding
    and subtracting 1.5 * 2^14 (whose float32 ulp is 2^-9) rounds to that step.
    """
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    subnormal = (tl.abs(x) + 24576.0) - 24576.0
    subnormal = tl.where(x < 0, -subnormal, subnormal)  # keep the sign of values that round to zero
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr, stride_kt,
    stride_kh, stride_vt, stride_vh, stride_kc_block, stride_kc_slot, stride_kc_head, stride_vc_block,
    stride_vc_slot, stride_vc_head, num_kv_heads, head_dim, num_slots, BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    # Negative slots are padding; a slot past the cache (possible only unchecked, inside
    # kiln.ops.trusted_inputs) is dropped rather than written outside the cache.
    if slot < 0:
        return
    if slot >= num_slots:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        # Saturate rather than overflow: e4m3fn has no infinity, an out-of-range cast would be NaN.
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < num_kv_heads, other=1.0)
        # div_rn: torch's correctly rounded division (Triton's float32 `/` is approximate, ~2 ulp)
        key = tl.math.div_rn(key.to(tl.float32), k_scale[:, None])
        value = tl.math.div_rn(value.to(tl.float32), v_scale[:, None])
        key = _round_to_e4m3(tl.clamp(key, -448.0, 448.0))
        value = _round_to_e4m3(tl.clamp(value, -448.0, 448.0))
    key_dst = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    value_dst = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(
        key_dst + heads[:, None] * stride_kc_head + dims[None, :],
        key.to(key_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        value_dst + heads[:, None] * stride_vc_head + dims[None, :],
        value.to(value_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def write_kv_cache_triton(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    quantize = key_cache.dtype in FP8_DTYPES
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale.float() if quantize else key,
        v_scale.float() if quantize else value, key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
        value_cache.stride(1), value_cache.stride(2), num_kv_heads, head_dim,
        key_cache.shape[0] * key_cache.shape[1], BLOCK_SIZE=key_cache.shape[1], QUANTIZE=quantize,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 2048 else 2,
    )  # fmt: skip


WRITE_KV_CACHE.register(Implementation("triton", write_kv_cache_triton, triton_available))
