"""Fast CPU write_kv_cache: float32 data into contiguous float32, bfloat16 or float16 caches through
Kiln's native kernel (write_kv_cache_cpu.cpp: one call, 16-bit values rounded as Tensor.to rounds
them, padding skipped without a host read-back); otherwise one index_copy_ per cache into its flat
[slots, Hkv, D] view (fp8 caches quantize in float32 first and move their bytes as uint8). Traced by
torch.compile (the compiled CPU decode step, kiln.engine.cpu_compiled_step), a float cache is written
in-graph by `_write_in_graph`."""

from __future__ import annotations

import torch

from kiln.ops import native_cpu
from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.attention.write_kv_cache.spec import WRITE_KV_CACHE
from kiln.ops.registry import Implementation, cpu_only

NATIVE_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the native write's caches
FP8_MAX = 448.0  # largest finite float8_e4m3fn; casting beyond it gives NaN, so saturate first


def _write_in_graph(key, value, key_cache, value_cache, slot_mapping) -> None:
    """The write as plain tensor code a compiled graph holds (no data-dependent filter). A padding
    row (slot < 0) repeats the first real row's write, its slot and its data, so whichever of the
    equal writes lands last the result is the same; with no real row every row writes slot 0 back
    with the value it holds. Either way exactly what the eager filter does."""
    valid = slot_mapping >= 0
    first = valid.int().argmax().view(1)  # the first real row (0 when there is none)
    any_valid = valid.any()
    slot = torch.where(any_valid, slot_mapping.index_select(0, first), 0)  # [1]
    slots = torch.where(valid, slot_mapping, slot)
    block_size = key_cache.shape[1]
    # (block, offset) into the 4-D cache: index_put_ on a flat view of a graph input fails to compile
    index = (slots // block_size, slots % block_size)
    for data, cache in ((key, key_cache), (value, value_cache)):
        data = data.to(cache.dtype)
        fill = torch.where(any_valid, data.index_select(0, first), cache[:1, 0])  # [1, Hkv, D]
        cache.index_put_(index, torch.where(valid[:, None, None], data, fill))


def _traceable(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None) -> bool:
    """Float caches are written in-graph; fp8 ones (scaling, a byte view) stay one opaque node."""
    return key_cache.dtype not in FP8_DTYPES


def write_kv_cache_cpu(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    if torch.compiler.is_compiling():  # only reached when _traceable says so (kiln.ops.registry)
        return _write_in_graph(key, value, key_cache, value_cache, slot_mapping)
    if (
        key.dtype == value.dtype == torch.float32
        and key_cache.dtype == value_cache.dtype
        and key_cache.dtype in NATIVE_CACHE_DTYPES
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and native_cpu.load()
    ):
        torch.ops.kiln_cpu.write_kv_cache(key, value, key_cache, value_cache, slot_mapping.long())
        return
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


WRITE_KV_CACHE.register(Implementation("cpu", write_kv_cache_cpu, cpu_only, traceable=_traceable))
