"""Input makers shared by the attention specs: random varlen batches and paged KV caches with
shuffled (non-contiguous) block tables. Fresh random data everywhere, including unused cache blocks,
so a kernel that reads the wrong block or token cannot pass by luck."""

from __future__ import annotations

import torch

from kiln.ops.attention.validate import FP8_DTYPES
from kiln.ops.testing import randn, uniform


def data_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of q/k/v for a spec dtype: float8_e4m3fn means float16 queries over an fp8 cache."""
    return torch.float16 if dtype in FP8_DTYPES else dtype


def lengths(shape: dict, key: str, default_key: str) -> list[int]:
    """Per-sequence lengths: an explicit list `shape[key]`, else `batch` copies of `shape[default_key]`."""
    if key in shape:
        return list(shape[key])
    return [shape[default_key]] * shape["batch"]


def host_lengths(lens: torch.Tensor, cumulative: bool = False) -> list[int] | None:
    """A call's per-sequence lengths on the host (`cumulative`: from cu_seqlens offsets), for
    `OpSpec.call_case`; None while a CUDA graph is being captured, where reading them would sync."""
    if lens.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    values = lens.tolist()
    return [b - a for a, b in zip(values[:-1], values[1:], strict=True)] if cumulative else values


def paged_call_case(q, key_cache, seq_lens, sliding_window, exact_key_cache, exact_window, **query_lens):
    """The case of a paged attention call (key_cache [blocks, block_size, kv_heads, head_dim]; its
    dtype is the case's: an fp8 cache makes an fp8 case), or None (`host_lengths`). query_lens:
    prefill's `query_lens` list."""
    context = host_lengths(seq_lens)
    if context is None or any(v is None for v in query_lens.values()):
        return None
    shape = {
        "batch": len(context), "context_lens": context, "num_heads": q.shape[-2],
        "num_kv_heads": key_cache.shape[2], "head_dim": q.shape[-1], "block_size": key_cache.shape[1],
        "sliding_window": sliding_window, **query_lens,
    }  # fmt: skip
    if exact_key_cache is not None:
        shape["exact_window"] = exact_window
    return shape, key_cache.dtype


def cu_seqlens(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device,
    generator: torch.Generator,
    extra_blocks: int = 3,
    exact_window: int | None = None,
) -> dict:
    """key_cache/value_cache `[num_blocks, block_size, Hkv, D]`, block_tables int32 (rows padded with
    -1 past each sequence's blocks), seq_lens int32, and k_scale/v_scale (fp8 only, else None).
    exact_window (fp8 only): also make_exact_kv's exact caches and tables for that window."""
    needed = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(needed) + extra_blocks
    order = torch.randperm(num_blocks, generator=generator)
    width = max(needed) if needed else 1
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    used = 0
    for row, count in enumerate(needed):
        block_tables[row, :count] = order[used : used + count].to(torch.int32)
        used += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv = {
        "block_tables": block_tables.to(device),
        "seq_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
        "k_scale": None,
        "v_scale": None,
    }
    if dtype in FP8_DTYPES:
        # Stored = value / scale: scales near 1/40 put unit-variance values well inside e4m3's +-448.
        for name in ("k", "v"):
            scale = uniform((num_kv_heads,), 0.02, 0.05, torch.float32, device, generator)
            values = randn(cache_shape, torch.float32, device, generator) / scale[:, None]
            kv[f"{name}_scale"] = scale
            kv[f"{'key' if name == 'k' else 'value'}_cache"] = values.clamp(-448, 448).to(dtype)
    else:
        kv["key_cache"] = randn(cache_shape, dtype, device, generator)
        kv["value_cache"] = randn(cache_shape, dtype, device, generator)
    if exact_window is not None and dtype in FP8_DTYPES:
        kv.update(make_exact_kv(len(context_lens), cache_shape[1:], exact_window, kv, device, generator))
    return kv


def make_exact_kv(
    num_seqs: int, block_shape: tuple, window: int, kv: dict, device, generator: torch.Generator
) -> dict:
    """exact_key_cache/exact_value_cache float16 `[num_exact_blocks, block_size, Hkv, D]`, in the fp8
    cache's units (value / scale) but drawn independently of it, so a kernel that reads an exact
    position from the wrong cache or the wrong ring entry is far off; exact_block_tables int32
    `[num_seqs, 1 + R]` over shuffled blocks, with the smallest ring the window allows plus one
    (ring entries then wrap at a different period than the window); exact_window."""
    block_size, num_kv_heads, _ = block_shape
    ring = -(-window // block_size) + 1 if window else 0
    num_blocks = num_seqs * (1 + ring) + 2
    order = torch.randperm(num_blocks, generator=generator)[: num_seqs * (1 + ring)]
    out = {
        "exact_block_tables": order.view(num_seqs, 1 + ring).to(device=device, dtype=torch.int32),
        "exact_window": window,
    }
    for name, scale in (("exact_key_cache", kv["k_scale"]), ("exact_value_cache", kv["v_scale"])):
        values = randn((num_blocks, *block_shape), torch.float32, device, generator) / scale[:, None]
        out[name] = values.to(torch.float16)
    return out


def make_paged_attention_inputs(
    shape: dict,
    context_lens: list[int],
    num_queries: int,
    dtype: torch.dtype,
    device,
    generator: torch.Generator,
    extra: dict | None = None,
) -> dict:
    """A paged attention op's kwargs: make_paged_kv's cache (with exact positions when the shape has an
    exact_window and the cache is fp8), q `[num_queries, H, D]` (float16 over an fp8 cache; larger
    scores when soft-capping, so the cap actually bends them), `extra`, then the shape's scale,
    sliding_window and softcap."""
    inputs = make_paged_kv(
        context_lens,
        shape["num_kv_heads"],
        shape["head_dim"],
        shape["block_size"],
        dtype,
        device,
        generator,
        exact_window=shape.get("exact_window"),
    )
    softcap = shape.get("softcap")
    inputs.update(
        {
            "q": randn(
                (num_queries, shape["num_heads"], shape["head_dim"]),
                data_dtype(dtype),
                device,
                generator,
                scale=3.0 if softcap else 1.0,
            ),
            **(extra or {}),
            "scale": shape.get("scale"),
            "sliding_window": shape.get("sliding_window"),
            "softcap": softcap,
        }
    )
    return inputs


def visible_pairs(q_len: int, k_len: int, causal: bool, sliding_window: int | None) -> int:
    """How many (query, key) pairs the mask keeps: the work of one head of one sequence."""
    if q_len == 0 or k_len == 0:
        return 0
    position = torch.arange(q_len, dtype=torch.int64) + (k_len - q_len)
    hi = torch.clamp(position + 1, max=k_len) if causal else torch.full_like(position, k_len)
    lo = (
        torch.clamp(position - sliding_window + 1, min=0)
        if sliding_window is not None
        else torch.zeros_like(position)
    )
    return int(torch.clamp(hi - lo, min=0).sum())


def exact_read(shape: dict, dtype: torch.dtype) -> int:
    """How many key positions (over all sequences) an fp8 case with exact positions reads from the
    exact caches: each sequence's first block and its last exact_window positions (0 otherwise)."""
    window = shape.get("exact_window")
    if window is None or dtype not in FP8_DTYPES:
        return 0
    block_size = shape["block_size"]
    total = 0
    for length in lengths(shape, "context_lens", "context"):
        total += min(length, block_size) + max(0, length - max(block_size, length - window))
    return total
