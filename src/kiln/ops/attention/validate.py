"""Argument checks shared by the attention ops: every failure is a ValueError naming the op, the
argument and the fix, raised before any kernel launches.

Written against shapes and dtypes (dtypes compared by name, devices only for torch tensors), so the
same checks validate jax arrays and tracers for `kiln.jax`; checks of index values run only on
torch tensors whose values the host may read (`host_checkable`)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from kiln.ops.checks import FLOAT_DTYPES, check_tensor, device_of, dtype_name

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
FP8_DTYPES = (torch.float8_e4m3fn,)
CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES + (torch.float64,)
QUERY_DTYPES = FLOAT_DTYPES + (torch.float64,)  # float64 only for the verifier's reference


def is_fp8(dtype: object) -> bool:
    """Whether a torch or jax dtype is one of the fp8 cache dtypes."""
    return dtype_name(dtype) in {dtype_name(d) for d in FP8_DTYPES}


def unit_last_stride(tensor: object) -> bool:
    """A unit stride along the last dim (jax arrays are always row-major)."""
    return not isinstance(tensor, torch.Tensor) or tensor.stride(-1) == 1


def host_checkable(tensor: object) -> bool:
    """Whether checks that read tensor values on the host may run: on real CPU tensors always; on a
    GPU only outside CUDA-graph capture (where reading would be illegal); never on fake or meta
    tensors (torch.compile tracing through the custom ops' fake implementations) nor on jax arrays
    (tracers under jit)."""
    if not isinstance(tensor, torch.Tensor):
        return False
    if tensor.device.type == "meta" or is_fake(tensor):
        return False
    return tensor.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def check_query(op: str, name: str, q: object, ndim: int = 3) -> torch.Tensor:
    q = check_tensor(op, name, q, ndim=ndim, dtypes=QUERY_DTYPES)
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"{op}: {name} has head_dim {q.shape[-1]}, supported head dims are "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    return q


def check_heads(op: str, num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{op}: q has {num_heads} heads, which is not a multiple of the {num_kv_heads} kv heads "
            "(GQA needs num_heads % num_kv_heads == 0)"
        )


def check_optional_positive(op: str, name: str, value: float | int | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{op}: {name} must be positive or None, got {value}")


def check_attention_options(
    op: str, scale: float | None, sliding_window: int | None, softcap: float | None
) -> None:
    """The optional scale, sliding_window and softcap every attention op takes: positive or None."""
    check_optional_positive(op, "scale", scale)
    check_optional_positive(op, "sliding_window", sliding_window)
    check_optional_positive(op, "softcap", softcap)


def check_cu_seqlens(
    op: str, name: str, cu_seqlens: object, num_seqs: int | None, device: torch.device | None
) -> int:
    """int32 `[B+1]`; returns B."""
    cu_seqlens = check_tensor(op, name, cu_seqlens, ndim=1, dtypes=(torch.int32,), device=device)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"{op}: {name} must have num_seqs + 1 >= 2 entries, got {cu_seqlens.shape[0]}")
    if num_seqs is not None and cu_seqlens.shape[0] != num_seqs + 1:
        raise ValueError(
            f"{op}: {name} has {cu_seqlens.shape[0]} entries, expected num_seqs + 1 = {num_seqs + 1}"
        )
    return cu_seqlens.shape[0] - 1


def check_lengths(
    op: str, name: str, cu_seqlens: torch.Tensor, total: int, max_seqlen: int, what: str
) -> None:
    """Values of cu_seqlens (host-side, skipped during CUDA-graph capture): starts at 0,
    non-decreasing, ends at the token count, no length above max_seqlen."""
    if not host_checkable(cu_seqlens):
        return
    values = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(values, values[1:], strict=False)]
    if values[0] != 0 or min(lengths) < 0:
        raise ValueError(f"{op}: {name} must start at 0 and be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"{op}: {name} ends at {values[-1]}, expected the number of {what} tokens {total}")
    if max(lengths) > max_seqlen:
        raise ValueError(
            f"{op}: a sequence in {name} has {max(lengths)} tokens, above max_seqlen {max_seqlen}"
        )


def check_paged_cache(
    op: str,
    key_cache: object,
    value_cache: object,
    k_scale: object,
    v_scale: object,
    q: torch.Tensor,
) -> tuple[int, int]:
    """`[num_blocks, block_size, Hkv, D]` caches in q's dtype (or fp8 with float32 `[Hkv]` scales).
    Returns (block_size, num_kv_heads)."""
    device = device_of(q)
    key_cache = check_tensor(op, "key_cache", key_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    value_cache = check_tensor(op, "value_cache", value_cache, ndim=4, dtypes=CACHE_DTYPES, device=device)
    same_dtype = dtype_name(key_cache.dtype) == dtype_name(value_cache.dtype)
    if tuple(key_cache.shape) != tuple(value_cache.shape) or not same_dtype:
        raise ValueError(
            f"{op}: key_cache {tuple(key_cache.shape)} {dtype_name(key_cache.dtype)} and value_cache "
            f"{tuple(value_cache.shape)} {dtype_name(value_cache.dtype)} must have one shape and dtype"
        )
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"{op}: key_cache block_size (dim 1) is {block_size}, expected a power of two")
    if head_dim != q.shape[-1]:
        raise ValueError(f"{op}: key_cache has head_dim {head_dim}, expected q's head_dim {q.shape[-1]}")
    if not (unit_last_stride(key_cache) and unit_last_stride(value_cache)):
        raise ValueError(f"{op}: key_cache and value_cache need a contiguous head_dim (stride 1)")
    check_heads(op, q.shape[-2], num_kv_heads)
    check_scales(op, key_cache, k_scale, v_scale, num_kv_heads, q.dtype)
    return block_size, num_kv_heads


def check_scales(
    op: str,
    key_cache: torch.Tensor,
    k_scale: object,
    v_scale: object,
    num_kv_heads: int,
    data_dtype: torch.dtype,
) -> None:
    """fp8 caches need float32 `[Hkv]` k_scale and v_scale; other caches take none, match the data dtype."""
    if is_fp8(key_cache.dtype):
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is None:
                raise ValueError(
                    f"{op}: the cache is {dtype_name(key_cache.dtype)}, so {name} "
                    f"(float32 [{num_kv_heads}]) is required"
                )
            check_tensor(
                op, name, scale, ndim=1, dtypes=(torch.float32, torch.float64), device=device_of(key_cache)
            )
            if scale.shape[0] != num_kv_heads:
                raise ValueError(
                    f"{op}: {name} has {scale.shape[0]} entries, expected num_kv_heads {num_kv_heads}"
                )
        return
    if k_scale is not None or v_scale is not None:
        raise ValueError(
            f"{op}: k_scale/v_scale apply only to float8_e4m3fn caches; "
            f"the cache is {dtype_name(key_cache.dtype)}"
        )
    if dtype_name(key_cache.dtype) != dtype_name(data_dtype):
        raise ValueError(
            f"{op}: key_cache is {dtype_name(key_cache.dtype)} but the data is {dtype_name(data_dtype)}; "
            "use one dtype (or a float8_e4m3fn cache with scales)"
        )


def check_block_tables(
    op: str,
    block_tables: object,
    seq_lens: object,
    num_seqs: int,
    block_size: int,
    device: torch.device | None,
    num_blocks: int | None = None,
) -> None:
    """int32 `[num_seqs, max_blocks]` and int32 `[num_seqs]`, with every sequence fitting its table row
    and, given the cache's `num_blocks`, every entry a sequence reads (the first ceil(seq_len /
    block_size) of its row) in [0, num_blocks): a kernel would otherwise read outside the cache.
    Entries past a sequence's length are never read and may hold anything (padding)."""
    block_tables = check_tensor(
        op, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=device
    )
    seq_lens = check_tensor(op, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"{op}: block_tables has {block_tables.shape[0]} rows and seq_lens {seq_lens.shape[0]} entries, "
            f"expected num_seqs {num_seqs}"
        )
    if not unit_last_stride(block_tables):
        raise ValueError(f"{op}: block_tables rows must be contiguous")
    if num_seqs and host_checkable(seq_lens):
        longest = int(seq_lens.max())
        capacity = block_tables.shape[1] * block_size
        if longest > capacity:
            raise ValueError(
                f"{op}: a sequence has seq_len {longest} but block_tables rows hold only "
                f"{block_tables.shape[1]} blocks x {block_size} = {capacity} tokens; widen block_tables"
            )
        if int(seq_lens.min()) < 1:
            raise ValueError(f"{op}: seq_lens must be >= 1, got {int(seq_lens.min())}")
        if num_blocks is not None and host_checkable(block_tables):
            pages_read = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [num_seqs]
            columns = torch.arange(block_tables.shape[1], device=block_tables.device)
            read = columns[None, :] < pages_read[:, None]
            bad = read & ((block_tables < 0) | (block_tables >= num_blocks))
            if bool(bad.any()):
                seq, column = (int(i) for i in bad.nonzero()[0])
                raise ValueError(
                    f"{op}: block_tables[{seq}, {column}] = {int(block_tables[seq, column])} is outside the "
                    f"cache's {num_blocks} blocks (sequence {seq} reads its first {int(pages_read[seq])} "
                    "entries)"
                )


def check_exact_cache(
    op: str,
    exact_key_cache: object,
    exact_value_cache: object,
    exact_block_tables: object,
    exact_window: object,
    key_cache: object,
    num_seqs: int,
) -> None:
    """The exact positions of an fp8 cache: float16 `[num_exact_blocks, block_size, Hkv, D]` caches
    matching key_cache's block size, heads and head dim, int32 `[num_seqs, 1 + R]` exact_block_tables
    whose ring (R columns: R * block_size positions, a circular buffer) holds a window of exact_window
    positions (R >= ceil(W / block_size)), every entry inside the exact caches. All three tensors or
    none; exact_window 0 without them."""
    given = [t is not None for t in (exact_key_cache, exact_value_cache, exact_block_tables)]
    if not isinstance(exact_window, int) or isinstance(exact_window, bool) or exact_window < 0:
        raise ValueError(f"{op}: exact_window must be a non-negative int, got {exact_window!r}")
    if not any(given):
        if exact_window:
            raise ValueError(
                f"{op}: exact_window={exact_window} needs exact_key_cache, exact_value_cache and "
                "exact_block_tables"
            )
        return
    if not all(given):
        raise ValueError(
            f"{op}: exact_key_cache, exact_value_cache and exact_block_tables go together; "
            "give all three or none"
        )
    if not is_fp8(key_cache.dtype):
        raise ValueError(
            f"{op}: exact caches keep an fp8 cache's first block and recent window unrounded; the cache "
            f"is {dtype_name(key_cache.dtype)}, not float8_e4m3fn"
        )
    device = device_of(key_cache)
    exact_dtypes = (torch.float16, torch.float64)  # float64: the verifier's reference
    exact_key_cache = check_tensor(
        op, "exact_key_cache", exact_key_cache, ndim=4, dtypes=exact_dtypes, device=device
    )
    exact_value_cache = check_tensor(
        op, "exact_value_cache", exact_value_cache, ndim=4, dtypes=exact_dtypes, device=device
    )
    if tuple(exact_key_cache.shape) != tuple(exact_value_cache.shape) or dtype_name(
        exact_key_cache.dtype
    ) != dtype_name(exact_value_cache.dtype):
        raise ValueError(
            f"{op}: exact_key_cache {tuple(exact_key_cache.shape)} and exact_value_cache "
            f"{tuple(exact_value_cache.shape)} must have one shape and dtype"
        )
    if tuple(exact_key_cache.shape[1:]) != tuple(key_cache.shape[1:]):
        raise ValueError(
            f"{op}: exact_key_cache blocks are {tuple(exact_key_cache.shape[1:])} [block_size, Hkv, D], "
            f"expected key_cache's {tuple(key_cache.shape[1:])}"
        )
    if not (unit_last_stride(exact_key_cache) and unit_last_stride(exact_value_cache)):
        raise ValueError(f"{op}: exact_key_cache and exact_value_cache need a contiguous head_dim (stride 1)")
    exact_block_tables = check_tensor(
        op, "exact_block_tables", exact_block_tables, ndim=2, dtypes=(torch.int32,), device=device
    )
    if exact_block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{op}: exact_block_tables has {exact_block_tables.shape[0]} rows, expected num_seqs {num_seqs}"
        )
    if not unit_last_stride(exact_block_tables):
        raise ValueError(f"{op}: exact_block_tables rows must be contiguous")
    if exact_block_tables.shape[1] < 1:
        raise ValueError(f"{op}: exact_block_tables needs at least one column (the first block's)")
    block_size = key_cache.shape[1]
    ring = exact_block_tables.shape[1] - 1
    needed = -(-exact_window // block_size)
    if ring < needed:
        raise ValueError(
            f"{op}: exact_block_tables has {ring} ring columns after the first block's, but a window of "
            f"{exact_window} positions needs {needed} blocks of {block_size}; widen it to {needed + 1} "
            "columns"
        )
    if num_seqs and host_checkable(exact_block_tables):
        num_blocks = exact_key_cache.shape[0]
        bad = (exact_block_tables < 0) | (exact_block_tables >= num_blocks)
        if bool(bad.any()):
            seq, column = (int(i) for i in bad.nonzero()[0])
            raise ValueError(
                f"{op}: exact_block_tables[{seq}, {column}] = {int(exact_block_tables[seq, column])} is "
                f"outside the exact caches' {num_blocks} blocks"
            )
