"""Kiln's public ops as `torch.library` custom ops: `torch.ops.kiln.<name>`.

Each op here wraps the plain `kiln.ops.<name>` function (which validates and dispatches to the
Triton / CPU / ... implementation) and has a fake (meta) implementation that gives the output's
shape, dtype and device without computing anything. So `torch.compile(fullgraph=True)` traces
through a model calling `torch.ops.kiln.*` as single opaque nodes without graph breaks, and CUDA
graphs capture the kernels as they are (vLLM registers its kernels the same way). Ops that write
into their arguments declare them in `mutates_args`, so functionalization orders them correctly.

    torch.ops.kiln.rms_norm(x, weight, eps=1e-6, residual=None) -> y       (mutates residual)
    torch.ops.kiln.layer_norm(x, weight, bias=None, eps=1e-5) -> y
    torch.ops.kiln.softmax(x, temperature=1.0) -> y
    torch.ops.kiln.silu_and_mul(x) -> y
    torch.ops.kiln.gelu_tanh_and_mul(x) -> y
    torch.ops.kiln.rotary_embedding(positions, q, k, cos_sin_cache, is_neox=True) -> None
                                                                                (mutates q and k)
A custom op may not return one of its inputs, so the in-place ones return only their fresh
outputs: `rms_norm` with a residual returns y (the residual is updated in place), and
`rotary_embedding` returns nothing. Eager callers (the CPU engine's hot path) keep calling
`kiln.ops.<name>` directly, which skips the dispatcher overhead.

Other families register theirs the same way, in this file, one decorated wrapper plus one fake each:
  attention: `kiln::write_kv_cache` (mutates_args=("key_cache", "value_cache"), returns None) and
             `kiln::flash_attention` / `kiln::paged_prefill_attention` / `kiln::paged_decode_attention`
             (no mutation; fake = torch.empty_like(q); return_lse as a second op or a fixed schema).
  gemm:      `kiln::linear`, `kiln::linear_silu_mul`, `kiln::gguf_linear`, `kiln::fp8_linear`,
             `kiln::int8_linear`, `kiln::int4_linear` (fake = x.new_empty(M, N) in the output dtype);
             `kiln::quantize_fp8` / `kiln::quantize_int8` return two fresh tensors (a tuple schema).
  moe:       `kiln::fused_moe` (fake = torch.empty_like(x)); routing returns (weights, ids) fakes.
  sampling:  `kiln::sample` (fake = an int64 [num_seqs] tensor); keep per-request Python state out
             of the op's arguments (tensors, ints, floats, bools and lists of those only).
"""

import torch

from kiln.ops.activation.spec import gelu_tanh_and_mul, silu_and_mul, validate_gated
from kiln.ops.attention.flash import flash_attention, validate_flash_attention
from kiln.ops.attention.kv_cache import validate_write_kv_cache, write_kv_cache
from kiln.ops.attention.paged_decode import paged_decode_attention, validate_paged_decode_attention
from kiln.ops.attention.paged_prefill import paged_prefill_attention, validate_paged_prefill_attention
from kiln.ops.rope.spec import rotary_embedding, validate_rotary_embedding
from kiln.ops.softmax.spec import softmax, validate_softmax

# Names registered under torch.ops.kiln by this module.
REGISTERED = ("rms_norm", "layer_norm", "softmax", "silu_and_mul", "gelu_tanh_and_mul", "rotary_embedding")
# The attention family's ops (kept apart: the foundation tests enumerate REGISTERED with their inputs).
ATTENTION_REGISTERED = (
    "write_kv_cache",
    "flash_attention",
    "flash_attention_with_lse",
    "paged_prefill_attention",
    "paged_decode_attention",
)


@torch.library.custom_op("kiln::softmax", mutates_args=())
def _softmax_op(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    return softmax(x, temperature)


@_softmax_op.register_fake
def _(x, temperature=1.0):
    validate_softmax(x, temperature)
    return torch.empty_like(x)


@torch.library.custom_op("kiln::silu_and_mul", mutates_args=())
def _silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul(x)


@_silu_and_mul_op.register_fake
def _(x):
    validate_gated("silu_and_mul", x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("kiln::gelu_tanh_and_mul", mutates_args=())
def _gelu_tanh_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    return gelu_tanh_and_mul(x)


@_gelu_tanh_and_mul_op.register_fake
def _(x):
    validate_gated("gelu_tanh_and_mul", x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("kiln::rotary_embedding", mutates_args=("q", "k"))
def _rotary_embedding_op(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    rotary_embedding(positions, q, k, cos_sin_cache, is_neox)


@_rotary_embedding_op.register_fake
def _(positions, q, k, cos_sin_cache, is_neox=True):
    validate_rotary_embedding(positions, q, k, cos_sin_cache)
    return None


@torch.library.custom_op("kiln::write_kv_cache", mutates_args=("key_cache", "value_cache"))
def _write_kv_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@_write_kv_cache_op.register_fake
def _(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    validate_write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return None


# flash_attention's result arity depends on return_lse, a schema cannot: two ops.
@torch.library.custom_op("kiln::flash_attention", mutates_args=())
def _flash_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    return flash_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        scale,
        sliding_window,
        softcap,
    )


@_flash_attention_op.register_fake
def _flash_attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True,
                          scale=None, sliding_window=None, softcap=None):  # fmt: skip
    validate_flash_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap,
    )  # fmt: skip
    return torch.empty_like(q)


@torch.library.custom_op("kiln::flash_attention_with_lse", mutates_args=())
def _flash_attention_with_lse_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap, return_lse=True,
    )  # fmt: skip


@_flash_attention_with_lse_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, scale=None,
      sliding_window=None, softcap=None):  # fmt: skip
    out = _flash_attention_fake(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, sliding_window,
        softcap,
    )  # fmt: skip
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("kiln::paged_prefill_attention", mutates_args=())
def _paged_prefill_attention_op(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_prefill_attention(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale, sliding_window,
        softcap, k_scale, v_scale,
    )  # fmt: skip


@_paged_prefill_attention_op.register_fake
def _(q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale=None,
      sliding_window=None, softcap=None, k_scale=None, v_scale=None):  # fmt: skip
    validate_paged_prefill_attention(
        q, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q, scale, sliding_window,
        softcap, k_scale, v_scale,
    )  # fmt: skip
    return torch.empty_like(q)


@torch.library.custom_op("kiln::paged_decode_attention", mutates_args=())
def _paged_decode_attention_op(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale
    )


@_paged_decode_attention_op.register_fake
def _(q, key_cache, value_cache, block_tables, seq_lens, scale=None, sliding_window=None, softcap=None,
      k_scale=None, v_scale=None):  # fmt: skip
    validate_paged_decode_attention(
        q, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window, softcap, k_scale, v_scale
    )
    return torch.empty_like(q)
