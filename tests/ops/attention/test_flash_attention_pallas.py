"""flash_attention and flash_attention_with_lse's JAX backends (Pallas TPU and GPU kernels, XLA)
against the specs' float64 references through the torch-facing implementations, and kiln.jax's
entries: the generated varlen one and the padded-batch layout adapter (kiln.jax.flash_attention)."""

import random

import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.flash_attention.pallas_tpu import flash_attention_padded_pallas_tpu  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")

FLASH_GQA_4_VARLEN = {
    "seqlens_q": [37, 5, 1],
    "seqlens_k": [37, 21, 19],  # bottom-right causal: short query runs see long contexts
    "num_heads": 4,
    "num_kv_heads": 1,
    "head_dim": 64,
}
FLASH_GQA_8_WINDOW_SOFTCAP = {
    "seqlens_q": [29],
    "seqlens_k": [29],
    "num_heads": 8,
    "num_kv_heads": 1,
    "head_dim": 80,
    "sliding_window": 7,
    "softcap": 5.0,
}
FLASH_MHA_NON_CAUSAL = {
    "seqlens_q": [18, 33],
    "seqlens_k": [40, 33],
    "num_heads": 3,
    "num_kv_heads": 3,
    "head_dim": 96,
    "causal": False,
}
# 150 queries: two query blocks and two key blocks of 128 on the TPU kernel.
FLASH_MULTI_BLOCK = {
    "seqlens_q": [150],
    "seqlens_k": [150],
    "num_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
}


@pytest.mark.parametrize(
    "backend, dtype, shape, with_lse",
    [
        ("pallas_tpu", torch.bfloat16, FLASH_GQA_4_VARLEN, True),
        ("pallas_tpu", torch.float32, FLASH_GQA_8_WINDOW_SOFTCAP, False),
        ("pallas_tpu", torch.float16, FLASH_MHA_NON_CAUSAL, True),
        ("pallas_tpu", torch.bfloat16, FLASH_MULTI_BLOCK, False),
        ("pallas_gpu", torch.bfloat16, FLASH_GQA_4_VARLEN, True),
        ("pallas_gpu", torch.float32, FLASH_GQA_8_WINDOW_SOFTCAP, False),
        ("xla", torch.bfloat16, FLASH_GQA_8_WINDOW_SOFTCAP, False),
    ],
    ids=lambda v: (
        v.get("num_kv_heads") and f"H{v['num_heads']}_Hkv{v['num_kv_heads']}"
        if isinstance(v, dict)
        else ("lse" if v is True else "out" if v is False else str(v))
    ),
)
def test_flash_attention_matches_float64_reference(backend, dtype, shape, with_lse):
    """The torch-facing implementations of the varlen ops (sequences gathered into a padded batch for
    the kernel and back), against the specs' float64 references."""
    op = get_op("flash_attention_with_lse" if with_lse else "flash_attention")
    case = run_case(op, backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


def test_flash_attention_tpu_interpreter_finds_no_races_on_two_cores():
    interpret_state = pytest.importorskip("jax._src.pallas.mosaic.interpret.interpret_pallas_call")
    q = jax.random.normal(jax.random.key(0), (1, 20, 4, 64), jnp.bfloat16)
    k = jax.random.normal(jax.random.key(1), (1, 24, 1, 64), jnp.bfloat16)
    with kjax.tpu_interpreter(detect_races=True, num_cores_or_threads=2):
        out = kjax.flash_attention(q, k, k, implementation="pallas_tpu")
        out.block_until_ready()
    races = getattr(interpret_state, "races", None)
    if races is None:
        pytest.skip("this JAX version keeps its race-detector state elsewhere")
    assert races.races_found is False
    ref = kjax.flash_attention(q, k, k, implementation="xla")
    assert (
        float(jnp.linalg.norm((out - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
        < 1e-2
    )


def test_generated_varlen_jax_entry_matches_the_padded_layout_adapter():
    """kiln.jax.flash_attention_with_lse is the op's own varlen signature (generated from the spec);
    kiln.jax.flash_attention keeps the padded-batch layout. Same kernel, same numbers."""
    lens = [5, 12]
    q = jax.random.normal(jax.random.key(0), (sum(lens), 4, 64), jnp.float32)
    k = jax.random.normal(jax.random.key(1), (sum(lens), 2, 64), jnp.float32)
    cu = jnp.array([0, 5, 17], jnp.int32)
    out, lse = kjax.flash_attention_with_lse(q, k, k, cu, cu, 12, 12, implementation="xla")
    assert out.shape == q.shape and lse.shape == (4, sum(lens))
    for b, (start, length) in enumerate(((0, 5), (5, 12))):
        rows = slice(start, start + length)
        padded, padded_lse = kjax.flash_attention(
            q[None, rows], k[None, rows], k[None, rows], implementation="xla", return_lse=True
        )
        assert jnp.allclose(out[rows], padded[0], atol=1e-6), f"sequence {b}"
        assert jnp.allclose(lse[:, rows], padded_lse[0], atol=1e-6), f"lse of sequence {b}"
    with pytest.raises(ValueError, match="cu_seqlens_q has dtype float32"):  # the spec's own validator
        kjax.flash_attention_with_lse(q, k, k, cu.astype(jnp.float32), cu, 12, 12)


def _flash(q_shape, kv_shape, **kwargs):
    return kjax.flash_attention(jnp.ones(q_shape), jnp.ones(kv_shape), jnp.ones(kv_shape), **kwargs)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: _flash((1, 4, 6, 64), (1, 4, 4, 64)), "not a multiple of the 4 kv heads"),
        (lambda: _flash((4, 6, 64), (4, 6, 64)), "q must have 4 dims"),
        (lambda: _flash((1, 4, 2, 64), (1, 4, 2, 64), sliding_window=0), "sliding_window must be positive"),
    ],
)
def test_flash_attention_rejects_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_flash_attention_tpu_kernel_lowers_to_mosaic(lower_for_tpu):
    q, k = jnp.ones((2, 37, 4, 64), jnp.bfloat16), jnp.ones((2, 45, 1, 64), jnp.bfloat16)
    lens = jnp.array([37, 5], jnp.int32)

    def lower(q, k, v, q_lens, kv_lens):
        return flash_attention_padded_pallas_tpu(
            q, k, v, q_lens, kv_lens, True, None, 7, 5.0, interpret=False
        )

    lower_for_tpu(lower, q, k, k, lens, lens)
