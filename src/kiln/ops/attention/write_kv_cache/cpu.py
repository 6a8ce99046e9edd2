"""Fast CPU write_kv_cache: one index_copy_ per cache into its flat [slots, Hkv, D] view (fp8 caches
quantize in float32 first and move their bytes as uint8)."""

from __future__ import annotations

import torch

from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.registry import Implementation, cpu_only

FP8_MAX = 448.0  # largest finite float8_e4m3fn; casting beyond it gives NaN, so saturate first


def write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for data, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if cache.dtype in FP8_DTYPES:
            data = (data.float() / scale.float()[None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
        data = data.to(cache.dtype)
        if cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel: move the bytes as uint8
            cache, data = cache.view(torch.uint8), data.view(torch.uint8)
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, data)
        else:  # strided cache view: index the (block, offset) pairs instead
            block_size = cache.shape[1]
            cache[slot_mapping // block_size, slot_mapping % block_size] = data


# traceable=False: the padding filter is data-dependent; a compiled decode step calls it as one node
WRITE_KV_CACHE.register(Implementation("cpu", write_kv_cache_cpu, cpu_only, traceable=False))
