"""LayerKVCache: what one attention layer's paged KV cache is made of.

A tuple, so the engine, the CUDA graphs and the compiled CPU step pass it as before, and a plain
(key_cache, value_cache) pair still is one (LayerKVCache(*pair)).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class LayerKVCache(NamedTuple):
    """key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], the model's dtype, a
    16-bit dtype under a float32 model, or float8_e4m3fn. An fp8 cache has:
      k_scale, v_scale: float32 [num_kv_heads] (stored = value / scale);
      k_shift: float32 [num_kv_heads, head_dim] or None, subtracted from every key before it is stored
        (kiln.engine.kv_scales);
      exact_key_cache, exact_value_cache: float16 [num_exact_blocks, block_size, num_kv_heads, head_dim]
        or None: the exact positions (each sequence's first block and recent window) as the fp8 cache
        stores them but unrounded (kiln.engine.exact_kv, paged_decode_attention's contract).
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_shift: torch.Tensor | None = None
    exact_key_cache: torch.Tensor | None = None
    exact_value_cache: torch.Tensor | None = None
