"""What the paged attention tests share: paged KV caches with a query batch, and the bad arguments
both paged ops must reject."""

import random

import torch

from kiln.ops.attention.paged_inputs import make_paged_kv

DTYPES = [torch.float32, torch.float16, torch.float8_e4m3fn]  # fp8: float16 queries over an fp8 cache


def decode_inputs(device, context_lens, heads, kv_heads, head_dim=64, block_size=16, dtype=torch.float16):
    """make_paged_kv's cache (shuffled blocks) and q [num_seqs, heads, head_dim]."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    inputs = make_paged_kv(context_lens, kv_heads, head_dim, block_size, dtype, device, gen)
    q_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    inputs["q"] = torch.randn(len(context_lens), heads, head_dim, generator=gen).to(q_dtype).to(device)
    return inputs


BAD_COMMON = [
    ({"q": torch.randn(2, 3, 64).half()}, "not a multiple of the 2 kv heads"),
    ({"q": torch.randn(2, 4, 48).half()}, "head_dim 48, supported head dims"),
    ({"q": torch.randn(2, 4, 64)}, "key_cache is float16 but the data is float32"),
    (
        {"block_tables": torch.zeros(2, 1, dtype=torch.int32)},
        "seq_len 20 but block_tables rows hold only 1 blocks",
    ),
    ({"block_tables": torch.zeros(2, 2, dtype=torch.int64)}, "block_tables has dtype int64"),
    ({"seq_lens": torch.tensor([20, 9])}, "seq_lens has dtype int64"),
    ({"seq_lens": torch.tensor([20], dtype=torch.int32)}, "seq_lens 1 entries"),
    ({"k_scale": torch.ones(2), "v_scale": torch.ones(2)}, "apply only to float8_e4m3fn"),
    ({"key_cache": torch.zeros(4, 16, 2, 64, dtype=torch.float16)}, "must have one shape and dtype"),
    (
        {"key_cache": torch.zeros(4, 12, 2, 64).half(), "value_cache": torch.zeros(4, 12, 2, 64).half()},
        "power of two",
    ),
    ({"sliding_window": 0}, "sliding_window must be positive"),
]
