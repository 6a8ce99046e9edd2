"""write_kv_cache's JAX backends (the Pallas TPU kernel in the TPU interpreter, the Pallas Triton kernel
in the Pallas interpreter, XLA) against the spec's reference through the torch-facing implementations
(the caches updated in place), kiln.jax's entry (the new caches returned), the fp8 conversion
bit-exact across backends, and the kernels' Mosaic and Triton lowerings."""

import random

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import kiln.jax as kjax  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.write_kv_cache.pallas_gpu import write_kv_cache_pallas_gpu  # noqa: E402
from kiln.ops.attention.write_kv_cache.pallas_tpu import write_kv_cache_pallas_tpu  # noqa: E402
from kiln.ops.attention.write_kv_cache.xla import write_kv_cache_xla  # noqa: E402
from kiln.ops.jax_bridge import to_jax  # noqa: E402
from kiln.verify import run_case  # noqa: E402

CPU = torch.device("cpu")
SKIPS_GQA = {"num_tokens": 9, "num_kv_heads": 2, "head_dim": 80, "num_blocks": 4, "block_size": 8,
             "skip_fraction": 0.5}  # fmt: skip
MANY_TOKENS = {"num_tokens": 37, "num_kv_heads": 3, "head_dim": 64, "num_blocks": 5, "block_size": 16,
               "skip_fraction": 0.3}  # fmt: skip


@pytest.mark.parametrize("backend", ["pallas_gpu", "pallas_tpu", "xla"])
@pytest.mark.parametrize(
    "dtype, shape",
    [(torch.float32, SKIPS_GQA), (torch.bfloat16, MANY_TOKENS), (torch.float8_e4m3fn, SKIPS_GQA)],
)
def test_write_kv_cache_jax_backends_match_the_reference(backend, dtype, shape):
    # Every slot the tokens do not name keeps its random value: comparing whole caches catches a
    # backend that writes a wrong slot or clobbers a neighbour.
    case = run_case(get_op("write_kv_cache"), backend, shape, dtype, CPU, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu", "xla"])
def test_write_kv_cache_kiln_jax_returns_new_caches_and_skips_negative_slots(implementation):
    key = jnp.arange(3 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 4)
    cache = jnp.full((2, 4, 2, 4), -7.0, jnp.float32)
    slots = jnp.array([5, -1, 0], jnp.int32)
    write = jax.jit(lambda *a: kjax.write_kv_cache(*a, implementation=implementation))
    new_k, new_v = write(key, key + 100, cache, cache, slots)
    want = np.full((8, 2, 4), -7.0, np.float32)
    want[5], want[0] = np.asarray(key[0]), np.asarray(key[2])
    np.testing.assert_array_equal(np.asarray(new_k).reshape(8, 2, 4), want)
    np.testing.assert_array_equal(np.asarray(new_v).reshape(8, 2, 4)[[0, 5]], np.asarray(key)[[2, 0]] + 100)
    np.testing.assert_array_equal(np.asarray(cache), -7.0)  # the input arrays are unchanged


def test_write_kv_cache_pallas_gpu_float16_into_fp8_is_bit_exact_with_xla():
    # 3 heads x 80 dims: a [4, 128] block masked to [3, 80]; saturation at +-448 and rounding as XLA's.
    shape = {**SKIPS_GQA, "num_kv_heads": 3}
    inputs = get_op("write_kv_cache").make_inputs(
        shape, torch.float8_e4m3fn, CPU, torch.Generator().manual_seed(random.randrange(2**31))
    )
    inputs["key"][0, 0, :4] = torch.tensor([1e4, -1e4, 0.0, 1e-4])  # saturated, zero, an fp8 subnormal
    args = [to_jax(inputs[n]) for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")]
    scales = [to_jax(inputs["k_scale"]), to_jax(inputs["v_scale"])]
    got = write_kv_cache_pallas_gpu(*args, *scales)
    want = write_kv_cache_xla(*args, *scales)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))


def test_write_kv_cache_kiln_jax_rejects_bad_input():
    key, cache = jnp.ones((2, 1, 8)), jnp.zeros((2, 4, 1, 8))
    with pytest.raises(ValueError, match="slot_mapping has dtype float32"):
        kjax.write_kv_cache(key, key, cache, cache, jnp.array([0.0, 3.0]))
    with pytest.raises(ValueError, match="slot_mapping has 3 entries, expected num_tokens 2"):
        kjax.write_kv_cache(key, key, cache, cache, jnp.array([0, 1, 2]))


@pytest.mark.parametrize("fp8", [False, True])
def test_write_kv_cache_tpu_kernel_lowers_to_mosaic(lower_for_tpu, fp8):
    key = jnp.ones((5, 2, 128), jnp.float16 if fp8 else jnp.bfloat16)
    cache = jnp.ones((4, 16, 2, 128), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    slots, scale = jnp.array([3, -1, 17, 40, 0], jnp.int32), jnp.ones((2,), jnp.float32)
    scales = (scale, scale) if fp8 else ()

    def lower(k, v, kc, vc, s, *scales):
        return write_kv_cache_pallas_tpu(k, v, kc, vc, s, *scales, interpret=False)

    lower_for_tpu(lower, key, key, cache, cache, slots, *scales)


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float32])
def test_write_kv_cache_gpu_kernel_lowers_to_triton(lower_for_gpu, cache_dtype):
    # The shared lowering test covers bf16 caches: an fp8 cache with its scales (3 heads, a masked
    # power-of-two block) and float32 here.
    fp8 = cache_dtype == jnp.float8_e4m3fn
    key = jnp.ones((5, 3, 80), jnp.float16 if fp8 else cache_dtype)
    cache = jnp.ones((4, 16, 3, 80), cache_dtype)
    slots, scale = jnp.array([3, -1, 17, 40, 0], jnp.int32), jnp.ones((3,), jnp.float32)
    scales = (scale, scale) if fp8 else ()

    def lower(k, v, kc, vc, s, *scales):
        return write_kv_cache_pallas_gpu(k, v, kc, vc, s, *scales, interpret=False)

    text = lower_for_gpu(lower, key, key, cache, cache, slots, *scales)
    assert ("div.rn.f32" in text) == fp8  # value / scale rounded once, as the Triton kernel divides
