import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.registry import Implementation
from kiln.ops.rope.qk_norm_rope import QK_NORM_ROPE
from kiln.verify import assert_close, run_case


def _seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 2},
        {"tokens": 5, "q_heads": 16, "kv_heads": 8, "head_dim": 128},  # Qwen3-0.6B heads
        {"tokens": 7, "q_heads": 4, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
        {"tokens": 3, "q_heads": 6, "kv_heads": 2, "head_dim": 96, "rotary_dim": 48},  # partial NeoX
        {"tokens": 2, "q_heads": 3, "kv_heads": 5, "head_dim": 10, "is_neox": False},  # more k heads than q
    ],
)
def test_qk_norm_rope_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(QK_NORM_ROPE, backend, shape, dtype, device, seed=_seed())
    assert case.passed, case


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    tokens=st.integers(1, 20),
    q_heads=st.integers(1, 10),
    kv_heads=st.integers(1, 4),
    half_head_dim=st.integers(1, 70),
    rotary_fraction=st.floats(0.05, 1.0),
    is_neox=st.booleans(),
)
def test_qk_norm_rope_triton_fuzzed_shapes(
    tokens, q_heads, kv_heads, half_head_dim, rotary_fraction, is_neox, device
):
    rotary_dim = 2 * max(1, round(half_head_dim * rotary_fraction))
    shape = {
        "tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": 2 * half_head_dim,
        "rotary_dim": rotary_dim, "is_neox": is_neox,
    }  # fmt: skip
    case = run_case(QK_NORM_ROPE, "triton", shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_qk_norm_rope_matches_transformers_qwen3_q_norm_then_apply_rotary_pos_emb(
    backend, device, monkeypatch
):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, head_dim, eps = 6, 64, 1e-6
    config = Qwen3Config(hidden_size=256, num_attention_heads=8, head_dim=head_dim, rope_theta=1000000.0)
    positions = torch.tensor([0, 1, 5, 31, 40, 63])
    q, k = torch.randn(tokens, 8, head_dim) * 3, torch.randn(tokens, 2, head_dim) * 3
    q_norm, k_norm = Qwen3RMSNorm(head_dim, eps), Qwen3RMSNorm(head_dim, eps)
    with torch.no_grad():
        q_norm.weight.copy_(torch.rand(head_dim) + 0.5)
        k_norm.weight.copy_(torch.rand(head_dim) + 0.5)
        cos, sin = Qwen3RotaryEmbedding(config)(q, positions[None])
        hf_q, hf_k = apply_rotary_pos_emb(
            q_norm(q).transpose(0, 1)[None], k_norm(k).transpose(0, 1)[None], cos, sin
        )
    cache = kiln.ops.rope_cos_sin_cache(head_dim, 64, 1000000.0, device=device)
    q_dev, k_dev = q.to(device), k.to(device)
    out_q, out_k = kiln.ops.qk_norm_rope(
        positions.to(device), q_dev, k_dev, q_norm.weight.detach().to(device),
        k_norm.weight.detach().to(device), cache, eps,
    )  # fmt: skip
    assert out_q is q_dev and out_k is k_dev
    assert_close(out_q, hf_q[0].transpose(0, 1), 1e-5)
    assert_close(out_k, hf_k[0].transpose(0, 1), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_qk_norm_rope_equals_rms_norm_then_rotary_embedding(backend, device, monkeypatch):
    # The fused op is the composition of the two existing ops (partial GPT-J rotary included).
    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, head_dim = 5, 48
    positions = torch.randint(0, 300, (tokens,), device=device)
    q, k = torch.randn(tokens, 5, head_dim, device=device), torch.randn(tokens, 3, head_dim, device=device)
    q_weight, k_weight = torch.rand(head_dim, device=device) + 0.5, torch.rand(head_dim, device=device) + 0.5
    cache = kiln.ops.rope_cos_sin_cache(20, 300, device=device)
    expected_q, expected_k = kiln.ops.rms_norm(q, q_weight, 1e-5), kiln.ops.rms_norm(k, k_weight, 1e-5)
    kiln.ops.rotary_embedding(positions, expected_q, expected_k, cache, is_neox=False)
    kiln.ops.qk_norm_rope(positions, q, k, q_weight, k_weight, cache, 1e-5, is_neox=False)
    assert_close(q, expected_q, 1e-5)
    assert_close(k, expected_k, 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_qk_norm_rope_in_place_on_views_of_a_fused_qkv_buffer(backend, device, monkeypatch):
    # The engine's q and k are slices of one [T, (Hq + 2 Hk) * D] projection output: strided token dim.
    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, hq, hk, d = 7, 6, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    positions = torch.randint(0, 256, (tokens,), device=device)
    q_weight, k_weight = torch.randn(d, device=device), torch.randn(d, device=device)
    cache = kiln.ops.rope_cos_sin_cache(d, 256, device=device)
    q_ref, k_ref = q.clone(), k.clone()
    QK_NORM_ROPE.reference(positions, q_ref, k_ref, q_weight, k_weight, cache)
    kiln.ops.qk_norm_rope(positions, q, k, q_weight, k_weight, cache)
    assert_close(qkv[:, : hq * d].view(tokens, hq, d), q_ref, 1e-5)
    assert_close(qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d), k_ref, 1e-5)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def _args(**overrides):
    args = {
        "positions": torch.tensor([0, 1, 2]),
        "q": torch.randn(3, 4, 16),
        "k": torch.randn(3, 2, 16),
        "q_weight": torch.randn(16),
        "k_weight": torch.randn(16),
        "cos_sin_cache": kiln.ops.rope_cos_sin_cache(8, 10),
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"positions": torch.tensor([0.0, 1.0, 2.0])}, "positions has dtype float32"),
        ({"q": torch.randn(2, 4, 16)}, "q has 2 tokens"),
        ({"k": torch.randn(3, 2, 16).half()}, "k has dtype float16"),
        ({"k": torch.randn(3, 2, 8)}, "k has head_dim 8, expected q's head_dim 16"),
        ({"q_weight": torch.randn(8)}, "q_weight has last dim 8, expected q's head_dim 16"),
        ({"k_weight": torch.randn(16).half()}, "must share one dtype"),
        ({"k_weight": torch.randn(2, 16)}, "k_weight must have 1 dims"),
        ({"cos_sin_cache": kiln.ops.rope_cos_sin_cache(32, 10)}, "rotary_dim 32 .* <= head_dim 16"),
        ({"q": torch.randn(3, 4, 32)[..., ::2]}, "q must have a unit stride in its last dim"),
        ({"eps": 0.0}, "eps must be positive"),
    ],
)
def test_qk_norm_rope_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.qk_norm_rope(**_args(**overrides))


def test_qk_norm_rope_tuning_configs_of_each_block_size_are_correct(device):
    shape = {"tokens": 3, "q_heads": 7, "kv_heads": 3, "head_dim": 40, "rotary_dim": 24, "is_neox": False}
    impl = QK_NORM_ROPE.implementations["triton"]
    configs = impl.configs(shape, torch.float32)
    by_block = {c["BLOCK_H"]: c for c in configs}  # one per block size (the tiling changes, warps do not)
    assert len(by_block) >= 3, configs
    for config in by_block.values():
        pinned = Implementation("pinned", functools.partial(impl.fn, config=config))
        spec = dataclasses.replace(QK_NORM_ROPE, implementations={"pinned": pinned})
        case = run_case(spec, "pinned", shape, torch.float32, device, seed=_seed())
        assert case.passed, (config, case)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 33, "q_heads": 32, "kv_heads": 4, "head_dim": 128},  # Qwen3-30B-A3B
        {"tokens": 5, "q_heads": 7, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
    ],
)
def test_qk_norm_rope_bfloat16_on_gpu(shape):
    case = run_case(QK_NORM_ROPE, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case
