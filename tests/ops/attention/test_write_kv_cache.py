import random

import pytest
import torch

import kiln.ops
from kiln.ops.attention.write_kv_cache import WRITE_KV_CACHE
from kiln.verify import run_case

SHAPES = [
    {"num_tokens": 1, "num_kv_heads": 1, "head_dim": 64, "num_blocks": 2, "block_size": 16},
    {
        "num_tokens": 37,
        "num_kv_heads": 3,
        "head_dim": 64,
        "num_blocks": 5,
        "block_size": 16,
        "skip_fraction": 0.3,
    },
    {
        "num_tokens": 23,
        "num_kv_heads": 2,
        "head_dim": 80,
        "num_blocks": 4,
        "block_size": 8,
        "skip_fraction": 0.5,
    },
]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
def test_write_kv_cache_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(WRITE_KV_CACHE, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


def _inputs(device, tokens=29, heads=3, head_dim=64, num_blocks=4, block_size=16, cache_dtype=torch.float16):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    key = torch.randn(tokens, heads, head_dim, generator=gen).half().to(device)
    value = torch.randn(tokens, heads, head_dim, generator=gen).half().to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::4] = -1  # padding tokens
    shape = (num_blocks, block_size, heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    value_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    return key, value, key_cache, value_cache, slots.to(device)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_negative_slots_are_skipped_and_other_slots_untouched(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    key, value, key_cache, value_cache, slots = _inputs(device)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    kiln.ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    written = torch.zeros(key_cache.shape[0] * key_cache.shape[1], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    flat_k, flat_v = key_cache.view(-1, *key.shape[1:]), value_cache.view(-1, *key.shape[1:])
    assert torch.equal(flat_k[~written], before_k.view(-1, *key.shape[1:])[~written])
    assert torch.equal(flat_v[~written], before_v.view(-1, *key.shape[1:])[~written])
    valid = slots >= 0
    assert torch.equal(flat_k[slots[valid]], key[valid])
    assert torch.equal(flat_v[slots[valid]], value[valid])


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_fp8_cache_rounds_to_nearest_like_torch_and_saturates(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    key, value, key_cache, value_cache, slots = _inputs(device, cache_dtype=torch.float8_e4m3fn)
    key[1, 0, :4] = torch.tensor([1e4, -1e4, 3e-4, -1e-6], dtype=torch.float16)  # saturate; subnormals
    k_scale = torch.tensor([0.02, 0.05, 0.011], device=device)
    v_scale = torch.tensor([0.03, 0.015, 0.04], device=device)
    kiln.ops.write_kv_cache(key, value, key_cache, value_cache, slots, k_scale, v_scale)
    valid = slots >= 0
    for data, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        expected = (data[valid].float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        got = cache.view(-1, *key.shape[1:])[slots[valid]]
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_write_kv_cache_triton_reads_strided_key_from_fused_qkv(device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", "triton")
    tokens, heads, kv_heads, head_dim = 11, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device)
    key = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    key_cache = torch.randn(2, 8, kv_heads, head_dim, device=device)
    value_cache = torch.randn(2, 8, kv_heads, head_dim, device=device)
    slots = torch.randperm(16, device=device)[:tokens]
    kiln.ops.write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(16, kv_heads, head_dim)[slots], key)
    assert torch.equal(value_cache.view(16, kv_heads, head_dim)[slots], value)


def _bad(**overrides):
    key, value, key_cache, value_cache, slots = _inputs(torch.device("cpu"))
    args = {
        "key": key,
        "value": value,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": slots,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"value": torch.randn(29, 2, 64).half()}, "value has shape"),
        ({"key_cache": torch.randn(4, 16, 2, 64).half()}, "key_cache holds"),
        ({"slot_mapping": torch.zeros(29, dtype=torch.int32)}, "slot_mapping has dtype int32"),
        ({"slot_mapping": torch.arange(28)}, "slot_mapping has 28 entries"),
        ({"slot_mapping": torch.arange(29) + 60}, "the cache holds 64 slots"),
        (
            {"key_cache": torch.randn(4, 16, 3, 64), "value_cache": torch.randn(4, 16, 3, 64)},
            "key_cache is float32",
        ),
        ({"k_scale": torch.ones(3), "v_scale": torch.ones(3)}, "apply only to float8_e4m3fn"),
        (
            {
                "key_cache": torch.zeros(4, 16, 3, 64, dtype=torch.float8_e4m3fn),
                "value_cache": torch.zeros(4, 16, 3, 64, dtype=torch.float8_e4m3fn),
            },
            "k_scale .* is required",
        ),
    ],
)
def test_write_kv_cache_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.write_kv_cache(**_bad(**overrides))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_native_cpu_write_rounds_float32_into_16_bit_caches_as_tensor_to(cache_dtype):
    """The native CPU write (float32 key/value, strided views of a fused QKV row) into float32 / bf16 /
    fp16 caches: each written row is Tensor.to's rounding of the data (ties and values past fp16's
    range included), padding rows write nothing, the other slots keep their poison."""
    from kiln.ops import native_cpu

    if not native_cpu.load():
        pytest.skip("Kiln's native CPU library is not built here")
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    tokens, heads, head_dim = 29, 3, 64
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen)
    qkv[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 70000.0, 1 + 2**-11])  # bf16 / fp16 ties, fp16 inf
    key = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    value = qkv[:, heads * head_dim : 2 * heads * head_dim].view(tokens, heads, head_dim)
    slots = torch.randperm(64, generator=gen)[:tokens]
    slots[::4] = -1
    key_cache = torch.full((4, 16, heads, head_dim), float("nan"), dtype=cache_dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    torch.ops.kiln_cpu.write_kv_cache(key, value, key_cache, value_cache, slots)
    valid = slots >= 0
    for data, cache in ((key, key_cache), (value, value_cache)):
        flat = cache.view(-1, heads, head_dim)
        assert torch.equal(flat[slots[valid]], data[valid].to(cache_dtype))
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots[valid]] = False
        assert flat[untouched].isnan().all()
    with pytest.raises(RuntimeError, match="caches must be contiguous float32, bfloat16 or float16"):
        torch.ops.kiln_cpu.write_kv_cache(key, value, key_cache, value_cache.double(), slots)
