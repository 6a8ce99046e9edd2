"""Where an fp8 cache's exact positions sit (exact_key_cache / exact_value_cache, the contract in
paged_decode_attention/spec.py), for the attention family's JAX backends: which positions are exact,
which exact_block_tables column holds a logical page's exact block, the gathered form the "xla"
backends lay over the fp8 pages, the TPU kernels' index map for the exact page of each step, and
the Pallas Triton kernels' masked overlay.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def static_exact_window(exact_block_tables, exact_window) -> int:
    """The kernels' static exact window: exact_window when the exact caches are given, else 0."""
    return 0 if exact_block_tables is None else int(exact_window)


def ring_size(exact_block_tables, window: int) -> int:
    """R, the ring columns of exact_block_tables [B, 1 + R] a kernel reads: none without a window
    (then only the first block is exact)."""
    return exact_block_tables.shape[1] - 1 if window else 0


def exact_rows(positions, seq_len, block_size: int, window: int):
    """bool, positions' shape: which key positions of a sequence of seq_len are read from the exact
    caches (its first block_size positions and its last `window`)."""
    exact = positions < block_size
    if window:
        exact |= positions >= seq_len - window
    return exact


def exact_window_page(seq_len, block_size: int, window: int):
    """The first logical page after page 0 holding one of the last `window` positions (int32)."""
    # lax.div on a non-negative value, as in last_kv_block (Mosaic).
    return jnp.maximum(jax.lax.div(jnp.maximum(seq_len - window, 0), jnp.int32(block_size)), 1)


def exact_column(page, window_page, ring: int):
    """The exact_block_tables column of logical page `page`'s exact block: the ring entry
    1 + page % R from window_page on, the first block's column 0 before (page >= 0, int32)."""
    if not ring:
        return jnp.zeros_like(page)
    return jnp.where(page >= window_page, 1 + jax.lax.rem(page, jnp.int32(ring)), 0)


def exact_page_rows(page, seq_len, block_size: int, window: int):
    """bool [block_size, 1]: which slots of logical page `page` are exact (exact_rows)."""
    positions = page * block_size + jax.lax.broadcasted_iota(jnp.int32, (block_size, 1), 0)
    return exact_rows(positions, seq_len, block_size, window)


def exact_physical_page(exact_tables_ref, b, page, first, last, seq_len, block_size, window, ring):
    """Index of the [block_size, Hkv, D] exact block that a TPU kernel's step on logical page `page`
    of sequence b holds, the page clamped to the visible [first, last] as in physical_page. A page
    without exact slots holds a block another step of the range needs too (the first block's when
    the range starts at page 0, else the window's first page's; the first block's when the range
    has no exact slot at all), so Pallas issues no copy for it."""
    page = jnp.clip(page, first, last)
    if not ring:
        return jnp.maximum(exact_tables_ref[b, 0], 0), 0, 0, 0
    window_page = exact_window_page(seq_len, block_size, window)
    held = jnp.where(page >= window_page, page, jnp.where(first == 0, 0, jnp.minimum(window_page, last)))
    return jnp.maximum(exact_tables_ref[b, exact_column(held, window_page, ring)], 0), 0, 0, 0


def gpu_exact_overlay(k, v, exact_refs, b, page, page_rows, seq_len, window_page, *, window, ring):
    """k, v float32 [block_size, D] of logical page `page` of sequence b, with the exact values at its
    exact slots (the Pallas Triton kernels). exact_refs: whole-array (exact_block_tables, exact_k,
    exact_v); page_rows indexes one kv head's [block_size, D] of a block; window_page is
    exact_window_page's. The exact rows load under a mask: a page without exact slots reads nothing."""
    from jax.experimental.pallas import triton as plgpu

    exact_tables_ref, exact_k_ref, exact_v_ref = exact_refs
    rows = exact_page_rows(page, seq_len, k.shape[0], window)
    block = jnp.maximum(exact_tables_ref[b, exact_column(page, window_page, ring)], 0)
    mask = jnp.broadcast_to(rows, k.shape)

    def overlay(ref, values):
        exact = plgpu.load(ref.at[(block, *page_rows)], mask=mask).astype(jnp.float32)
        return jnp.where(rows, exact, values)

    return overlay(exact_k_ref, k), overlay(exact_v_ref, v)


def overlay_exact(pages, exact_cache, exact_block_tables, window, seq_lens):
    """pages [B, S, Hkv, D] (an fp8 cache's pages gathered, not yet scaled) -> float32, position j of
    sequence b taken from exact_cache [num_exact_blocks, block_size, Hkv, D] where it is exact
    (exact_rows), at the slot exact_block_tables int32 [B, 1 + R] names for it (exact_column)."""
    batch, width = pages.shape[:2]
    block_size = exact_cache.shape[1]
    positions = jnp.arange(width, dtype=jnp.int32)[None, :]
    exact = exact_rows(positions, seq_lens[:, None], block_size, window)  # [B, S]
    # Every page after the first reads its ring entry here; only the window's positions keep it.
    column = exact_column(positions // block_size, 1, ring_size(exact_block_tables, window))
    blocks = jnp.take_along_axis(exact_block_tables, jnp.broadcast_to(column, (batch, width)), axis=1)
    flat = exact_cache.reshape(-1, *exact_cache.shape[2:])
    values = flat[jnp.maximum(blocks, 0) * block_size + positions % block_size]
    return jnp.where(exact[:, :, None, None], values.astype(jnp.float32), pages.astype(jnp.float32))
