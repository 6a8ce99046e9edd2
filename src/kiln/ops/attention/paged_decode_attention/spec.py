"""paged_decode_attention: one new query token per sequence over its paged context.

q:              [num_seqs, num_heads, head_dim]  float32 / float16 / bfloat16 (the newest token)
key_cache,
value_cache:    [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, or float8_e4m3fn with
                k_scale, v_scale float32 [num_kv_heads] (value = stored * scale)
block_tables:   int32 [num_seqs, max_blocks_per_seq] (entries past a sequence's blocks are not read)
seq_lens:       int32 [num_seqs], context length including the new token (already in the cache);
                cache slots at or past a sequence's seq_len are never read (they may hold anything)
The query sits at position seq_len - 1 and sees every key (causal is trivially satisfied); a
sliding window W keeps keys j > seq_len - 1 - W; soft-capping as in flash_attention.
exact_key_cache,
exact_value_cache: an fp8 cache's exact positions (optional, all three or none): float16
                [num_exact_blocks, block_size, num_kv_heads, head_dim] holding the values in the fp8
                cache's units (value / scale) unrounded and unsaturated: a value beyond e4m3's +-448
                stays as it is there (the engine clamps only at float16's +-65504)
exact_block_tables: int32 [num_seqs, 1 + R]: column 0 the exact block of the sequence's first
                block_size positions, columns 1..R a ring for its last exact_window positions
                (position j in column 1 + (j // block_size) % R at offset j % block_size: a circular
                buffer of R * block_size positions; R >= ceil(exact_window / block_size))
exact_window:   W >= 0. Key j of a sequence of seq_len L is read from the exact caches when
                j < block_size or j >= L - W, from the fp8 cache otherwise (then scaled as usual).
Returns out [num_seqs, num_heads, head_dim] in q's dtype.
"""

from __future__ import annotations

import torch

from kiln.ops.attention.paged_inputs import (
    data_dtype,
    exact_read,
    lengths,
    make_paged_attention_inputs,
    paged_call_case,
)
from kiln.ops.attention.reference import attend_one_sequence, gather_paged
from kiln.ops.attention.validate import (
    check_attention_options,
    check_block_tables,
    check_exact_cache,
    check_paged_cache,
    check_query,
)
from kiln.ops.checks import device_of
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size

OP = "paged_decode_attention"


def paged_decode_attention_reference(
    q,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    scale=None,
    sliding_window=None,
    softcap=None,
    k_scale=None,
    v_scale=None,
    exact_key_cache=None,
    exact_value_cache=None,
    exact_block_tables=None,
    exact_window=0,
):
    out = torch.zeros_like(q)
    for b, k_len in enumerate(seq_lens.tolist()):
        exact_k = exact_v = None
        if exact_block_tables is not None:
            exact_k = (exact_key_cache, exact_block_tables[b], exact_window)
            exact_v = (exact_value_cache, exact_block_tables[b], exact_window)
        k = gather_paged(key_cache, block_tables[b], k_len, k_scale, exact_k).to(q.dtype)
        v = gather_paged(value_cache, block_tables[b], k_len, v_scale, exact_v).to(q.dtype)
        o, _ = attend_one_sequence(q[b : b + 1], k, v, scale, True, sliding_window, softcap)
        out[b] = o[0]
    return out


def validate_paged_decode_attention(
    q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale,
    exact_key_cache, exact_value_cache, exact_block_tables, exact_window,
) -> None:  # fmt: skip
    q = check_query(OP, "q", q)
    block_size, _ = check_paged_cache(OP, key_cache, value_cache, k_scale, v_scale, q)
    check_block_tables(OP, block_tables, seq_lens, q.shape[0], block_size, device_of(q), key_cache.shape[0])
    check_attention_options(OP, scale, sliding_window, softcap)
    check_exact_cache(
        OP, exact_key_cache, exact_value_cache, exact_block_tables, exact_window, key_cache, q.shape[0]
    )


def paged_decode_tune_shape(q, key_cache, block_tables) -> dict:
    """The tuning-cache key, built without reading device memory (context = block table capacity)."""
    return {
        "batch": q.shape[0],
        "context": block_tables.shape[1] * key_cache.shape[1],
        "num_heads": q.shape[1],
        "num_kv_heads": key_cache.shape[2],
        "head_dim": q.shape[2],
        "block_size": key_cache.shape[1],
    }


def _make_inputs(shape, dtype, device, generator):
    """dtype float8_e4m3fn: float16 queries over an fp8 cache (with exact positions when the shape
    has an exact_window; other dtypes ignore that key)."""
    lens = lengths(shape, "context_lens", "context")
    return make_paged_attention_inputs(shape, lens, len(lens), dtype, device, generator)


# fp8 with exact positions (the fuzz shapes; the JAX tests run them by name)
EXACT_RING_WRAPS_AND_SHORT_SEQUENCE = {
    "context_lens": [5, 20, 37, 70],  # 5: inside its first block; 20: window reaches into it; 70: wraps
    "num_heads": 9,
    "num_kv_heads": 3,
    "head_dim": 64,
    "block_size": 16,
    "exact_window": 20,
}
EXACT_WINDOW_WITH_SLIDING_WINDOW = {
    "context_lens": [61, 33],  # the sliding window (40) hides the first block of the 61-long sequence
    "num_heads": 8,
    "num_kv_heads": 2,
    "head_dim": 64,
    "block_size": 8,
    "exact_window": 16,
    "sliding_window": 40,
}
EXACT_FIRST_BLOCK_ONLY = {  # W = 0: exact_block_tables has its first column only
    "context_lens": [50],
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 128,
    "block_size": 16,
    "exact_window": 0,
}
EXACT_FUZZ_SHAPES = (
    EXACT_RING_WRAPS_AND_SHORT_SEQUENCE,
    EXACT_WINDOW_WITH_SLIDING_WINDOW,
    EXACT_FIRST_BLOCK_ONLY,
)


# A context long enough that a GPU splits it: the Triton launcher's partitions hold >= 256 tokens there
# (triton.py _partition_size; tuned ones 256..2048), and 656 slots make 3 partitions by the heuristic
# (2 with 512), so `kiln verify` on a GPU checks the split-K partials and their combine, not only the
# single-split kernel; the interpreter's partitions are 32 tokens, so every shape splits there. The
# 3-token sequence beside it leaves partitions past its end empty. One KV head keeps it cheap.
LONG_CONTEXT_SPLITS_ON_GPU = {
    "context_lens": [650, 3],
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
    "block_size": 16,
}


def _fuzz_shapes(rng):
    shapes = [
        {"context_lens": [1], "num_heads": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
        {
            "context_lens": [37, 1, 16, 70],
            "num_heads": 9,
            "num_kv_heads": 3,
            "head_dim": 64,
            "block_size": 16,
        },
        {
            "context_lens": [45, 33],
            "num_heads": 8,
            "num_kv_heads": 1,
            "head_dim": 80,
            "block_size": 8,
            "sliding_window": 20,
            "softcap": 5.0,
        },
        {"context_lens": [100], "num_heads": 4, "num_kv_heads": 4, "head_dim": 256, "block_size": 32},
        dict(LONG_CONTEXT_SPLITS_ON_GPU),
        *(dict(shape) for shape in EXACT_FUZZ_SHAPES),
    ]  # fmt: skip
    shapes.append(
        {
            "context_lens": [rng.randint(1, 90) for _ in range(rng.randint(1, 4))],
            "num_heads": 8,
            "num_kv_heads": rng.choice([1, 2, 8]),
            "head_dim": rng.choice([64, 96, 128]),
            "block_size": rng.choice([8, 16]),
            "sliding_window": rng.choice([None, rng.randint(1, 50)]),
            "exact_window": rng.choice([None, rng.randint(0, 40)]),
        }
    )
    return shapes


def _visible(shape) -> list[int]:
    window = shape.get("sliding_window")
    return [min(n, window) if window else n for n in lengths(shape, "context_lens", "context")]


def _flops(shape, dtype):
    return 4 * sum(_visible(shape)) * shape["num_heads"] * shape["head_dim"]


def _bytes(shape, dtype):
    """Dominated by the KV read: 2 * seq_len * num_kv_heads * head_dim * elem_size per sequence (an
    fp8 cache's exact positions at float16's 2 bytes)."""
    d = shape["head_dim"]
    kv = 2 * sum(_visible(shape)) * shape["num_kv_heads"] * d * element_size(dtype)
    kv += 2 * exact_read(shape, dtype) * shape["num_kv_heads"] * d
    batch = len(lengths(shape, "context_lens", "context"))
    return kv + 2 * batch * shape["num_heads"] * d * element_size(data_dtype(dtype))


def _call_case(q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale,
               v_scale, exact_key_cache, exact_value_cache, exact_block_tables, exact_window):  # fmt: skip
    return paged_call_case(q, key_cache, seq_lens, sliding_window, exact_key_cache, exact_window)


def _gather_sdpa(**inputs):
    """Gather each sequence's pages, one masked SDPA: the op's CPU path (cpu.py), on the bench's device."""
    return PAGED_DECODE_ATTENTION.implementation("cpu").fn(**inputs)


def _llm_shapes():
    shapes = []
    for batch in (1, 8, 32, 128):  # GQA 8:1 (Llama-3-70B per-GPU-like heads), head_dim 128
        for context in (512, 4096, 32768):
            if batch * context <= 32 * 32768:
                shapes.append(
                    {
                        "batch": batch,
                        "context": context,
                        "num_heads": 32,
                        "num_kv_heads": 4,
                        "head_dim": 128,
                        "block_size": 16,
                    }
                )
    for batch in (1, 16):  # SmolLM2-135M
        for context in (128, 512, 2048):
            shapes.append(
                {
                    "batch": batch,
                    "context": context,
                    "num_heads": 9,
                    "num_kv_heads": 3,
                    "head_dim": 64,
                    "block_size": 16,
                }
            )
    return shapes


PAGED_DECODE_ATTENTION = OpSpec(
    name=OP,
    description="flash-decoding over the paged KV cache: split-K partitions, fp8 cache read path",
    reference=paged_decode_attention_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn),
    # As flash_attention; the split partials are combined in float32. fp8: float16 queries, exact
    # fp8 -> fp16 conversion, scales applied in float32, so the fp16 bound holds.
    tolerance={
        torch.float32: 2e-5,
        torch.float16: 1e-3,
        torch.bfloat16: 8e-3,
        torch.float8_e4m3fn: 1e-3,
    },
    flops=_flops,
    bytes=_bytes,
    bench_shapes={"llm": _llm_shapes()},
    baselines={"gather_sdpa": _gather_sdpa},
    gpu_only_dtypes={"triton": (torch.bfloat16,)},
    schema=(
        "(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens, "
        "float? scale=None, int? sliding_window=None, float? softcap=None, Tensor? k_scale=None, "
        "Tensor? v_scale=None, Tensor? exact_key_cache=None, Tensor? exact_value_cache=None, "
        "Tensor? exact_block_tables=None, int exact_window=0) -> Tensor"
    ),
    validate=validate_paged_decode_attention,
    fake=lambda q, *args: torch.empty_like(q),
    call_case=_call_case,
    doc=__doc__,
)

paged_decode_attention = define_op(PAGED_DECODE_ATTENTION, "kiln.ops")
