"""paged_prefill_attention: prefill/extend attention reading K/V from the paged cache.

q:              [total_q, num_heads, head_dim]  float32 / float16 / bfloat16
key_cache,
value_cache:    [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, or float8_e4m3fn with
                k_scale, v_scale float32 [num_kv_heads] (value = stored * scale)
block_tables:   int32 [num_seqs, max_blocks_per_seq]; token t of sequence b is in block
                block_tables[b, t // block_size] at offset t % block_size (entries past the
                sequence's last block are never read)
cu_seqlens_q:   int32 [num_seqs + 1]; sequence b has q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b]
seq_lens:       int32 [num_seqs], the full context length k_len >= q_len of each sequence
Sequence b's queries are its **last** q_len tokens, whose keys/values are already in the cache
(write_kv_cache first): chunked prefill, prefix-cache hits and mixed batches where decodes have
q_len 1. Causal, bottom-right aligned; sliding window and soft-capping as in flash_attention.
exact_key_cache, exact_value_cache, exact_block_tables, exact_window: an fp8 cache's exact positions,
                as in paged_decode_attention: key j of a sequence of seq_len L is read from the exact
                caches when j < block_size or j >= L - exact_window (for every query of the sequence:
                the window follows the context's end, not each query's position)
Returns out [total_q, num_heads, head_dim] in q's dtype.
"""

from __future__ import annotations

import torch

from kiln.ops.attention import cpu_sdpa
from kiln.ops.attention.paged_inputs import (
    cu_seqlens,
    data_dtype,
    exact_read,
    host_lengths,
    lengths,
    make_paged_attention_inputs,
    paged_call_case,
    visible_pairs,
)
from kiln.ops.attention.reference import attend_one_sequence, gather_paged
from kiln.ops.attention.validate import (
    check_attention_options,
    check_block_tables,
    check_cu_seqlens,
    check_exact_cache,
    check_lengths,
    check_paged_cache,
    check_query,
    host_checkable,
)
from kiln.ops.checks import device_of
from kiln.ops.registry import OpSpec, define_op
from kiln.ops.testing import element_size

OP = "paged_prefill_attention"


def paged_prefill_attention_reference(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    max_seqlen_q,
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
    starts = cu_seqlens_q.tolist()
    for b, k_len in enumerate(seq_lens.tolist()):
        exact_k = exact_v = None
        if exact_block_tables is not None:
            exact_k = (exact_key_cache, exact_block_tables[b], exact_window)
            exact_v = (exact_value_cache, exact_block_tables[b], exact_window)
        k = gather_paged(key_cache, block_tables[b], k_len, k_scale, exact_k).to(q.dtype)
        v = gather_paged(value_cache, block_tables[b], k_len, v_scale, exact_v).to(q.dtype)
        o, _ = attend_one_sequence(q[starts[b] : starts[b + 1]], k, v, scale, True, sliding_window, softcap)
        out[starts[b] : starts[b + 1]] = o
    return out


def validate_paged_prefill_attention(
    q,
    key_cache,
    value_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    max_seqlen_q,
    scale,
    sliding_window,
    softcap,
    k_scale,
    v_scale,
    exact_key_cache,
    exact_value_cache,
    exact_block_tables,
    exact_window,
) -> None:
    q = check_query(OP, "q", q)
    block_size, _ = check_paged_cache(OP, key_cache, value_cache, k_scale, v_scale, q)
    num_seqs = check_cu_seqlens(OP, "cu_seqlens_q", cu_seqlens_q, None, device_of(q))
    check_block_tables(OP, block_tables, seq_lens, num_seqs, block_size, device_of(q), key_cache.shape[0])
    if not isinstance(max_seqlen_q, int) or max_seqlen_q < 0:
        raise ValueError(f"{OP}: max_seqlen_q must be a non-negative int, got {max_seqlen_q!r}")
    check_lengths(OP, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "query")
    if host_checkable(seq_lens):
        q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        for b, (q_len, k_len) in enumerate(zip(q_lens, seq_lens.tolist(), strict=True)):
            if q_len > k_len:
                raise ValueError(
                    f"{OP}: sequence {b} has {q_len} queries but seq_len {k_len}; the queries are "
                    "the last q_len tokens of the context, so seq_lens must include them"
                )
    check_attention_options(OP, scale, sliding_window, softcap)
    check_exact_cache(
        OP, exact_key_cache, exact_value_cache, exact_block_tables, exact_window, key_cache, num_seqs
    )


def paged_prefill_tune_shape(q, key_cache, block_tables, max_seqlen_q) -> dict:
    """The tuning-cache key, built without reading device memory (context = block table capacity)."""
    return {
        "batch": block_tables.shape[0],
        "seqlen_q": max_seqlen_q,
        "context": block_tables.shape[1] * key_cache.shape[1],
        "num_heads": q.shape[1],
        "num_kv_heads": key_cache.shape[2],
        "head_dim": q.shape[2],
        "block_size": key_cache.shape[1],
    }


def _make_inputs(shape, dtype, device, generator):
    """dtype float8_e4m3fn: float16 queries over an fp8 cache (with exact positions when the shape
    has an exact_window; other dtypes ignore that key)."""
    lens_q = lengths(shape, "query_lens", "seqlen_q")
    lens_k = lengths(shape, "context_lens", "context")
    extra = {"cu_seqlens_q": cu_seqlens(lens_q, device), "max_seqlen_q": max(lens_q)}
    return make_paged_attention_inputs(shape, lens_k, sum(lens_q), dtype, device, generator, extra)


# fp8 with exact positions (the fuzz shapes; the JAX tests run them by name): a prefill shorter than
# its first block, chunks whose queries straddle the window's start, a decode (q_len 1), a ring that
# wraps; and a window with a sliding window, whose early queries still see the first block
EXACT_MIXED_RING_WRAPS = {
    "query_lens": [9, 21, 1, 12],
    "context_lens": [9, 40, 35, 70],
    "num_heads": 6,
    "num_kv_heads": 2,
    "head_dim": 64,
    "block_size": 16,
    "exact_window": 20,
}
EXACT_WITH_SLIDING_WINDOW = {
    "query_lens": [19],
    "context_lens": [50],
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
    "block_size": 8,
    "sliding_window": 30,
    "exact_window": 9,
}
EXACT_FUZZ_SHAPES = (EXACT_MIXED_RING_WRAPS, EXACT_WITH_SLIDING_WINDOW)


def _fuzz_shapes(rng):
    shapes = [
        # a mixed batch: a fresh prefill, a chunk after a prefix hit, two decodes (q_len 1)
        {
            "query_lens": [21, 9, 1, 1],
            "context_lens": [21, 40, 1, 35],
            "num_heads": 4,
            "num_kv_heads": 1,
            "head_dim": 64,
            "block_size": 16,
        },
        {
            "query_lens": [19],
            "context_lens": [50],
            "num_heads": 8,
            "num_kv_heads": 1,
            "head_dim": 80,
            "block_size": 8,
            "sliding_window": 13,
            "softcap": 5.0,
        },
        {
            "query_lens": [7, 16],
            "context_lens": [7, 33],
            "num_heads": 3,
            "num_kv_heads": 3,
            "head_dim": 128,
            "block_size": 16,
        },
        *(dict(shape) for shape in EXACT_FUZZ_SHAPES),
    ]
    q_lens = [rng.randint(1, 30) for _ in range(2)]
    shapes.append(
        {
            "query_lens": q_lens,
            "context_lens": [n + rng.randint(0, 30) for n in q_lens],
            "num_heads": 4,
            "num_kv_heads": rng.choice([1, 2, 4]),
            "head_dim": 64,
            "block_size": rng.choice([8, 16]),
            "sliding_window": rng.choice([None, rng.randint(1, 40)]),
            "exact_window": rng.choice([None, rng.randint(0, 40)]),
        }
    )
    return shapes


def _flops(shape, dtype):
    lens_q, lens_k = lengths(shape, "query_lens", "seqlen_q"), lengths(shape, "context_lens", "context")
    pairs = sum(
        visible_pairs(a, b, True, shape.get("sliding_window")) for a, b in zip(lens_q, lens_k, strict=True)
    )
    return 4 * pairs * shape["num_heads"] * shape["head_dim"]


def _bytes(shape, dtype):
    tokens_q = sum(lengths(shape, "query_lens", "seqlen_q"))
    tokens_k = sum(lengths(shape, "context_lens", "context"))
    d, kv_heads = shape["head_dim"], shape["num_kv_heads"]
    q_and_out = 2 * tokens_q * shape["num_heads"] * d * element_size(data_dtype(dtype))
    kv = 2 * tokens_k * kv_heads * d * element_size(dtype)
    return q_and_out + kv + 2 * exact_read(shape, dtype) * kv_heads * d  # exact positions: 2 bytes


def _call_case(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale,
               sliding_window, softcap, k_scale, v_scale, exact_key_cache, exact_value_cache,
               exact_block_tables, exact_window):  # fmt: skip
    query_lens = host_lengths(cu_seqlens_q, cumulative=True)
    return paged_call_case(
        q, key_cache, seq_lens, sliding_window, exact_key_cache, exact_window, query_lens=query_lens
    )


def _gather_sdpa(**inputs):
    """Gather each sequence's context, one SDPA per sequence: the op's CPU path (cpu.py) without
    Kiln's native causal kernel, on the bench's device."""
    with cpu_sdpa.without_native():
        return PAGED_PREFILL_ATTENTION.implementation("cpu").fn(**inputs)


def _llm_shapes():
    shapes = []
    for seqlen_q, context in ((1024, 1024), (4096, 4096), (512, 8192), (16384, 16384)):  # Llama-3-8B heads
        shapes.append(
            {
                "batch": 1,
                "seqlen_q": seqlen_q,
                "context": context,
                "num_heads": 32,
                "num_kv_heads": 8,
                "head_dim": 128,
                "block_size": 16,
            }
        )
    for seqlen_q, context in ((128, 128), (512, 2048)):  # SmolLM2-135M
        shapes.append(
            {
                "batch": 4,
                "seqlen_q": seqlen_q,
                "context": context,
                "num_heads": 9,
                "num_kv_heads": 3,
                "head_dim": 64,
                "block_size": 16,
            }
        )
    return shapes


PAGED_PREFILL_ATTENTION = OpSpec(
    name=OP,
    description="causal prefill/extend attention over the paged KV cache (chunked prefill, mixed)",
    reference=paged_prefill_attention_reference,
    make_inputs=_make_inputs,
    fuzz_shapes=_fuzz_shapes,
    dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn),
    # As flash_attention. fp8: float16 queries; the fp8 values convert to fp16 exactly and the
    # scales are applied in float32, so the fp16 bound holds against the dequantized reference.
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
        "(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor cu_seqlens_q, "
        "Tensor seq_lens, int max_seqlen_q, float? scale=None, int? sliding_window=None, "
        "float? softcap=None, Tensor? k_scale=None, Tensor? v_scale=None, Tensor? exact_key_cache=None, "
        "Tensor? exact_value_cache=None, Tensor? exact_block_tables=None, int exact_window=0) -> Tensor"
    ),
    validate=validate_paged_prefill_attention,
    fake=lambda q, *args: torch.empty_like(q),
    call_case=_call_case,
    doc=__doc__,
)

paged_prefill_attention = define_op(PAGED_PREFILL_ATTENTION, "kiln.ops")
