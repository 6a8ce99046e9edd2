"""write_kv_cache: scatter new keys and values into the paged KV cache.

key, value:      [num_tokens, num_kv_heads, head_dim]  float32 / float16 / bfloat16
key_cache,
value_cache:     [num_blocks, block_size, num_kv_heads, head_dim], modified in place; same dtype as
                 key, or float8_e4m3fn with k_scale, v_scale float32 [num_kv_heads]
slot_mapping:    int64 [num_tokens] (int32 also for JAX arrays); slot = block * block_size + offset;
                 negative = skip (padding)
For each token t with slot s >= 0: key_cache[s // block_size, s % block_size] = key[t] (divided by
k_scale per kv head, saturated to +-448 and rounded to e4m3 for fp8 caches); likewise value.
Returns None. The paged cache layout is the attention family's (kiln.ops.attention).
"""

from __future__ import annotations

import torch

from kiln.ops.attention.validate import FP8_DTYPES, check_scales, host_checkable, unit_last_stride
from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, dtype_name
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size, fused_qkv_views, randn, uniform

OP = "write_kv_cache"


def write_kv_cache_reference(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    block_size = key_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    for data, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        rows = data[valid].to(cache.dtype)
        if scale is not None:
            rows = rows / scale.to(cache.dtype)[None, :, None]
        cache[slots // block_size, slots % block_size] = rows


def validate_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    key = check_tensor(OP, "key", key, ndim=3, dtypes=FLOAT_DTYPES + (torch.float64,))
    value = check_tensor(OP, "value", value, ndim=3, dtypes=(key.dtype,), device=device_of(key))
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"{OP}: value has shape {tuple(value.shape)}, expected key's {tuple(key.shape)}")
    if key.shape[1] == 0 or key.shape[2] == 0:
        raise ValueError(f"{OP}: key has shape {tuple(key.shape)}; num_kv_heads and head_dim must be >= 1")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        cache = check_tensor(OP, name, cache, ndim=4, device=device_of(key))
        if tuple(cache.shape[2:]) != tuple(key.shape[1:]):
            raise ValueError(
                f"{OP}: {name} holds [num_kv_heads, head_dim] = {list(cache.shape[2:])} per slot, "
                f"expected key's {list(key.shape[1:])}"
            )
        if not unit_last_stride(cache):
            raise ValueError(f"{OP}: {name} needs a contiguous head_dim (stride 1)")
    same_dtype = dtype_name(key_cache.dtype) == dtype_name(value_cache.dtype)
    if tuple(key_cache.shape) != tuple(value_cache.shape) or not same_dtype:
        raise ValueError(f"{OP}: key_cache and value_cache must have one shape and dtype")
    check_scales(OP, key_cache, k_scale, v_scale, key.shape[1], key.dtype)
    # JAX arrays may be int32 (JAX's default integer without jax_enable_x64); torch tensors are int64.
    slot_dtypes = (torch.int64,) if isinstance(slot_mapping, torch.Tensor) else (torch.int64, torch.int32)
    slot_mapping = check_tensor(
        OP, "slot_mapping", slot_mapping, ndim=1, dtypes=slot_dtypes, device=device_of(key)
    )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"{OP}: slot_mapping has {slot_mapping.shape[0]} entries, expected num_tokens {key.shape[0]}"
        )
    if host_checkable(slot_mapping) and slot_mapping.numel():  # values: torch tensors on the host only
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        if int(slot_mapping.max()) >= num_slots:
            raise ValueError(
                f"{OP}: slot_mapping has slot {int(slot_mapping.max())}, the cache holds {num_slots} slots"
            )


def _make_inputs(shape, dtype, device, generator):
    """dtype float8_e4m3fn means a float16 key/value written into an fp8 cache."""
    tokens, heads, head_dim = shape["num_tokens"], shape["num_kv_heads"], shape["head_dim"]
    num_blocks, block_size = shape["num_blocks"], shape["block_size"]
    fp8 = dtype in FP8_DTYPES
    data_dtype = torch.float16 if fp8 else dtype
    cache_shape = (num_blocks, block_size, heads, head_dim)
    # Distinct slots anywhere in the cache; a few negative (padding) entries.
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    skip = torch.rand(tokens, generator=generator) < shape.get("skip_fraction", 0.0)
    slots[skip] = -1
    if shape.get("fused_qkv"):
        _, key, value = fused_qkv_views(tokens, 2 * heads, heads, head_dim, data_dtype, device, generator)
    else:
        key = randn((tokens, heads, head_dim), data_dtype, device, generator)
        value = randn((tokens, heads, head_dim), data_dtype, device, generator)
    inputs = {
        "key": key,
        "value": value,
        "slot_mapping": slots.to(device),
        "k_scale": None,
        "v_scale": None,
    }
    if fp8:
        inputs["k_scale"] = uniform((heads,), 0.02, 0.05, torch.float32, device, generator)
        inputs["v_scale"] = uniform((heads,), 0.02, 0.05, torch.float32, device, generator)
        inputs["key_cache"] = (randn(cache_shape, torch.float32, device, generator) * 50).to(dtype)
        inputs["value_cache"] = (randn(cache_shape, torch.float32, device, generator) * 50).to(dtype)
    else:
        inputs["key_cache"] = randn(cache_shape, dtype, device, generator)
        inputs["value_cache"] = randn(cache_shape, dtype, device, generator)
    return inputs


def _fuzz_shapes(rng):
    shapes = [
        {"num_tokens": 1, "num_kv_heads": 1, "head_dim": 64, "num_blocks": 2, "block_size": 16},
        {
            "num_tokens": 37,
            "num_kv_heads": 3,
            "head_dim": 64,
            "num_blocks": 5,
            "block_size": 16,
            "skip_fraction": 0.3,
        },
        {
            "num_tokens": 9,
            "num_kv_heads": 2,
            "head_dim": 80,
            "num_blocks": 4,
            "block_size": 8,
            "skip_fraction": 0.5,
        },
        # key and value as views into a fused QKV buffer (token stride: the whole row), as the engine
        {"num_tokens": 7, "num_kv_heads": 2, "head_dim": 64, "num_blocks": 3, "block_size": 8,
         "fused_qkv": True},  # fmt: skip
    ]
    for _ in range(2):
        block_size = rng.choice([8, 16, 32])
        blocks = rng.randint(1, 6)
        shapes.append(
            {
                "num_tokens": rng.randint(1, blocks * block_size),
                "num_kv_heads": rng.choice([1, 2, 4]),
                "head_dim": rng.choice([64, 96, 128]),
                "num_blocks": blocks,
                "block_size": block_size,
                "skip_fraction": rng.random() * 0.5,
            }
        )
    return shapes


def _bytes(shape, dtype):
    elements = 2 * shape["num_tokens"] * shape["num_kv_heads"] * shape["head_dim"]
    data_size = 2 if dtype in FP8_DTYPES else element_size(dtype)
    return elements * (data_size + element_size(dtype)) + 8 * shape["num_tokens"]


def _torch_index_put(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """Plain PyTorch: drop the padding slots, index_copy_ into a flat view of each cache (no fp8)."""
    valid = slot_mapping >= 0
    slots, flat = slot_mapping[valid], (-1,) + tuple(key_cache.shape[2:])
    key_cache.view(flat).index_copy_(0, slots, key[valid].to(key_cache.dtype))
    value_cache.view(flat).index_copy_(0, slots, value[valid].to(value_cache.dtype))


def _llm_shapes():
    shapes = []
    for heads, head_dim in ((3, 64), (8, 128)):  # SmolLM2-135M, Llama-3-8B
        for tokens in (1, 32, 512, 8192):
            shapes.append(
                {
                    "num_tokens": tokens,
                    "num_kv_heads": heads,
                    "head_dim": head_dim,
                    "num_blocks": max(tokens // 16 * 2, 64),
                    "block_size": 16,
                }
            )
    return shapes


WRITE_KV_CACHE = OpSpec(
    name=OP,
    description="scatter keys/values into the paged KV cache through slot_mapping (fp8 quantizing)",
    reference=write_kv_cache_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn),
    # A copy is exact. fp8: e4m3 keeps 3 mantissa bits and both backends round to nearest, so
    # each element errs by <= 2^-4 relative (subnormals below 2^-6 by <= 2^-10 absolute,
    # negligible in the norm), checked per element too: truncation errs by up to 2^-3.
    tolerance={torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 0.0, torch.float8_e4m3fn: 2**-4},
    pointwise={torch.float8_e4m3fn: 1.05},  # each written element one round-to-nearest
    flops=lambda s, dtype: (
        2 * s["num_tokens"] * s["num_kv_heads"] * s["head_dim"] if dtype in FP8_DTYPES else 0
    ),
    bytes=_bytes,
    outputs=lambda result, inputs: (inputs["key_cache"], inputs["value_cache"]),
    bench_shapes={"llm": _llm_shapes()},
    baselines={"torch_index_copy": _torch_index_put},
    schema=(
        "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
        "Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
    ),
    validate=validate_write_kv_cache,
    fake=lambda *args: None,
    call_case=lambda key, value, key_cache, value_cache, *_: (
        {"num_tokens": key.shape[0], "num_kv_heads": key.shape[1], "head_dim": key.shape[2]},
        key_cache.dtype,
    ),
    doc=__doc__,
)

write_kv_cache = define_op(WRITE_KV_CACHE, "kiln.ops")
