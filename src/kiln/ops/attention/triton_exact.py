"""An fp8 cache's exact positions in the Triton paged attention kernels (the contract is in
paged_decode_attention/spec.py): whether a key tile holds one, the tile with the exact values laid
over the fp8 ones, and the launch arguments both exact kernels take. Used by
paged_decode_attention/triton.py and triton_prefill.py.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_has_exact(tile_start, tile_end, window_start, PAGE_SIZE: tl.constexpr):
    """Whether key tokens [tile_start, tile_end) (tile_end already cut at the context's end) hold an
    exact position: the first block (< PAGE_SIZE) or the window [window_start, context end)."""
    return (tile_start < PAGE_SIZE) | (tile_end > window_start)


@triton.jit
def overlay_exact_tile(
    tile, offs_n, offs_d, in_range, window_start, exact_row_ptr, exact_head_ptr, stride_eb, stride_et,
    num_exact_blocks, exact_ring, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """tile [BLOCK_N, BLOCK_D] (the keys or values of tokens offs_n, read from the fp8 cache and
    converted) with its exact positions replaced by the exact cache's float16 values, in the same
    (unscaled) units: tokens below PAGE_SIZE from exact block exact_row[0], tokens from window_start
    on from exact_row[1 + (t // PAGE_SIZE) % exact_ring], at offset t % PAGE_SIZE. Only the exact
    positions are loaded; in_range [BLOCK_N] marks the tokens this program reads at all."""
    first_block = offs_n < PAGE_SIZE
    exact = in_range & (first_block | (offs_n >= window_start))
    column = tl.where(first_block, 0, 1 + (offs_n // PAGE_SIZE) % exact_ring)
    block = tl.load(exact_row_ptr + column, mask=exact, other=0)
    # Unchecked exact tables may hold entries outside the exact caches: clamped like the block tables.
    block = tl.minimum(tl.maximum(block, 0), num_exact_blocks - 1).to(tl.int64)
    rows = block * stride_eb + (offs_n % PAGE_SIZE) * stride_et
    # The fp8 tile as the masked load's `other` rather than a tl.where after it: fewer registers
    # (compiled for sm_90 at Llama-3-8B heads, head_dim 128: decode 204 instead of 222 with Triton 3.6,
    # 166 instead of 249 with 3.9; prefill 206 / 198 instead of 220 / 222). The round trip through
    # float16 is exact: the tile holds e4m3 values, converted.
    values = tl.load(
        exact_head_ptr + rows[:, None] + offs_d[None, :],
        mask=exact[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=tile.to(exact_head_ptr.dtype.element_ty),
    )
    return values.to(tile.dtype)


def exact_kernel_args(exact_key_cache, exact_value_cache, exact_block_tables, exact_window) -> tuple:
    """The exact-position arguments both paged kernels take, in their order: the caches, the table,
    the caches' block/token/head strides, the table's row stride, num_exact_blocks, the ring length
    (at least 1: with R = 0 no ring column is ever read, and the kernels never divide by 0) and W."""
    return (
        exact_key_cache, exact_value_cache, exact_block_tables, *exact_key_cache.stride()[:3],
        *exact_value_cache.stride()[:3], exact_block_tables.stride(0), exact_key_cache.shape[0],
        max(exact_block_tables.shape[1] - 1, 1), int(exact_window),
    )  # fmt: skip
