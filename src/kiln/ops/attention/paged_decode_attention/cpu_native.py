"""The native CPU paged decode kernel (cpu_native.cpp, part of Kiln's native CPU library, see
kiln.ops.native_cpu for how and when it is built): torch.ops.kiln_cpu.paged_decode (float caches) and
torch.ops.kiln_cpu.paged_decode_fp8 (float8_e4m3fn caches with their scales and exact positions), with
fake implementations so a compiled graph holds them as one node.

`load()` returns True when the op is usable; where the library cannot be built (no C++ compiler or
ninja, or KILN_CPU_NATIVE=0) it returns False and callers keep their pure-PyTorch path.
"""

from __future__ import annotations

import torch

from kiln.ops import native_cpu

_state: dict = {"loaded": None, "head_dims": frozenset()}
NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def load() -> bool:
    """Load Kiln's native CPU library (kiln.ops.native_cpu: built on a host's first call) and register
    this op's fake, once per process. True when it can be called. Call it eagerly (not while
    torch.compile traces) before relying on ready()."""
    if _state["loaded"] is None:
        _state["loaded"] = native_cpu.load()
        if _state["loaded"]:
            _register_fake()
            dims = range(8, 513, 8)
            _state["head_dims"] = frozenset(d for d in dims if torch.ops.kiln_cpu.supports_head_dim(d))
    return _state["loaded"]


def ready(head_dim: int, cache_dtype: torch.dtype) -> bool:
    """Whether the op is loaded and built for this head dim and cache dtype (no build: plain Python
    that torch.compile evaluates while tracing)."""
    return bool(_state["loaded"]) and head_dim in _state["head_dims"] and cache_dtype in NATIVE_DTYPES


def _register_fake() -> None:
    @torch.library.register_fake("kiln_cpu::paged_decode")
    def _(q, key_cache, value_cache, block_tables, seq_lens, scale, window):
        return torch.empty_like(q)

    @torch.library.register_fake("kiln_cpu::paged_decode_fp8")
    def _(q, key_cache, value_cache, block_tables, seq_lens, scale, window, k_scale, v_scale, *exact):
        return torch.empty_like(q)


def paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window):
    """q [B, H, D] (float32 / bfloat16 / float16); caches [num_blocks, block_size, Hkv, D] (float);
    block_tables [B, W], seq_lens [B] (int32 or int64). Returns [B, H, D] in q's dtype: softmax(scale
    q k^T) v over each sequence's first seq_lens[b] positions (its last sliding_window ones if set).
    Requires load() to have returned True."""
    window = -1 if sliding_window is None else int(sliding_window)
    return torch.ops.kiln_cpu.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, window)


def paged_decode_fp8(
    q, key_cache, value_cache, block_tables, seq_lens, scale: float, sliding_window, k_scale, v_scale,
    exact_key_cache=None, exact_value_cache=None, exact_block_tables=None, exact_window: int = 0,
):  # fmt: skip
    """paged_decode over float8_e4m3fn caches with k_scale, v_scale float32 [Hkv] (value = stored *
    scale) and optionally an fp8 cache's exact positions (float16 exact caches [num_exact_blocks,
    block_size, Hkv, D], exact_block_tables int32 [B, 1 + R], exact_window: paged_decode_attention's
    contract). Returns [B, H, D] in q's dtype. Requires load() to have returned True."""
    window = -1 if sliding_window is None else int(sliding_window)
    return torch.ops.kiln_cpu.paged_decode_fp8(
        q, key_cache, value_cache, block_tables, seq_lens, scale, window, k_scale, v_scale, exact_key_cache,
        exact_value_cache, exact_block_tables, int(exact_window),
    )  # fmt: skip
