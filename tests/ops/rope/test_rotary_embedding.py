import dataclasses
import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kiln.ops
from kiln.ops.registry import Implementation
from kiln.ops.rope.cache import rope_inv_freq
from kiln.ops.rope.rotary_embedding import ROTARY_EMBEDDING
from kiln.verify import assert_close, run_case
from tests.ops.rope.hf_rope import SCALINGS, hf_llama_config


def _seed():
    return random.randrange(2**31)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 1, "q_heads": 1, "kv_heads": 1, "head_dim": 2},
        {"tokens": 5, "q_heads": 9, "kv_heads": 3, "head_dim": 64},  # SmolLM2-135M, GQA 3:1
        {"tokens": 7, "q_heads": 4, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
        {"tokens": 3, "q_heads": 6, "kv_heads": 2, "head_dim": 96, "rotary_dim": 48},  # partial NeoX
        {"tokens": 2, "q_heads": 3, "kv_heads": 5, "head_dim": 10, "is_neox": False},  # more k heads than q
    ],
)
def test_rotary_embedding_matches_float64_reference(backend, dtype, shape, device):
    case = run_case(ROTARY_EMBEDDING, backend, shape, dtype, device, seed=_seed())
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
def test_rotary_embedding_triton_fuzzed_shapes(
    tokens, q_heads, kv_heads, half_head_dim, rotary_fraction, is_neox, device
):
    rotary_dim = 2 * max(1, round(half_head_dim * rotary_fraction))
    shape = {
        "tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": 2 * half_head_dim,
        "rotary_dim": rotary_dim, "is_neox": is_neox,
    }  # fmt: skip
    case = run_case(ROTARY_EMBEDDING, "triton", shape, torch.float32, device, seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("name", ["default", "llama3"])
def test_rotary_embedding_matches_transformers_apply_rotary_pos_emb(backend, name, device, monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, head_dim = 6, 64
    config = hf_llama_config(head_dim, SCALINGS[name], 500000.0)
    positions = torch.tensor([0, 1, 5, 31, 40, 63])  # small: HF's float32 angles stay exact to ~1e-6
    q, k = torch.randn(tokens, 8, head_dim), torch.randn(tokens, 2, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = kiln.ops.rope_cos_sin_cache(head_dim, 64, 500000.0, SCALINGS[name], device=device)
    q_dev, k_dev = q.to(device), k.to(device)
    out_q, out_k = kiln.ops.rotary_embedding(positions.to(device), q_dev, k_dev, cache, is_neox=True)
    assert out_q is q_dev and out_k is k_dev
    assert_close(out_q, hf_q[0].transpose(0, 1), 1e-5)
    assert_close(out_k, hf_k[0].transpose(0, 1), 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_gptj_style_is_complex_multiplication_of_interleaved_pairs(backend, device, monkeypatch):
    # GPT-J / original Meta Llama convention: (x[2i], x[2i+1]) is a complex number times e^{i p f_i}.
    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, head_dim, rotary_dim = 5, 24, 16
    positions = torch.randint(0, 500, (tokens,))
    q, k = torch.randn(tokens, 3, head_dim), torch.randn(tokens, 1, head_dim)
    angles = positions.double()[:, None] * rope_inv_freq(rotary_dim)[None, :]
    phase = torch.polar(torch.ones_like(angles), angles)[:, None, :]
    expected = []
    for x in (q, k):
        rotated = torch.view_as_real(
            torch.view_as_complex(x[..., :rotary_dim].double().reshape(tokens, -1, 8, 2)) * phase
        )
        expected.append(torch.cat([rotated.flatten(-2), x[..., rotary_dim:].double()], -1))
    cache = kiln.ops.rope_cos_sin_cache(rotary_dim, 500, device=device)
    out_q, out_k = kiln.ops.rotary_embedding(
        positions.to(device), q.to(device), k.to(device), cache, is_neox=False
    )
    assert_close(out_q, expected[0], 1e-5)
    assert_close(out_k, expected[1], 1e-5)


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("is_neox", [True, False])
def test_partial_rotary_leaves_the_other_dims_bitwise_untouched(backend, is_neox, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    q, k = torch.randn(4, 5, 48, device=device).half(), torch.randn(4, 2, 48, device=device).half()
    q_before, k_before = q.clone(), k.clone()
    cache = kiln.ops.rope_cos_sin_cache(20, 100, dtype=torch.float16, device=device)
    kiln.ops.rotary_embedding(torch.tensor([3, 99, 0, 50], device=device), q, k, cache, is_neox)
    assert torch.equal(q[..., 20:], q_before[..., 20:]) and torch.equal(k[..., 20:], k_before[..., 20:])
    assert not torch.equal(q[1:, :, :20], q_before[1:, :, :20])


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_rotary_embedding_in_place_on_views_of_a_fused_qkv_buffer(backend, device, monkeypatch):
    # The engine's q and k are slices of one [T, (Hq + 2 Hk) * D] projection output: strided token dim.
    monkeypatch.setenv("KILN_BACKEND", backend)
    tokens, hq, hk, d = 7, 6, 2, 32
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device=device)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v_before = qkv[:, (hq + hk) * d :].clone()
    positions = torch.randint(0, 256, (tokens,), device=device)
    cache = kiln.ops.rope_cos_sin_cache(d, 256, device=device)
    q_ref, k_ref = q.clone(), k.clone()
    ROTARY_EMBEDDING.reference(positions, q_ref, k_ref, cache)
    kiln.ops.rotary_embedding(positions, q, k, cache)
    assert_close(qkv[:, : hq * d].view(tokens, hq, d), q_ref, 1e-6)
    assert_close(qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d), k_ref, 1e-6)
    assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def _rope_args(**overrides):
    args = {
        "positions": torch.tensor([0, 1, 2]),
        "q": torch.randn(3, 4, 16),
        "k": torch.randn(3, 2, 16),
        "cos_sin_cache": kiln.ops.rope_cos_sin_cache(8, 10),
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"positions": torch.tensor([0.0, 1.0, 2.0])}, "positions has dtype float32"),
        ({"q": torch.randn(2, 4, 16)}, "q has 2 tokens"),
        ({"q": torch.randn(3, 64)}, "q must have 3 dims"),
        ({"k": torch.randn(3, 2, 16).half()}, "k has dtype float16"),
        ({"k": torch.randn(3, 2, 8)}, "k has head_dim 8, expected q's head_dim 16"),
        ({"cos_sin_cache": torch.randn(10, 7)}, "rotary_dim 7"),
        ({"cos_sin_cache": kiln.ops.rope_cos_sin_cache(32, 10)}, "rotary_dim 32 .* <= head_dim 16"),
        ({"q": torch.randn(3, 4, 32)[..., ::2]}, "q must have a unit stride in its last dim"),
    ],
)
def test_rotary_embedding_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.rotary_embedding(**_rope_args(**overrides))


def test_rotary_embedding_tuning_configs_of_each_block_size_are_correct(device):
    shape = {"tokens": 3, "q_heads": 7, "kv_heads": 3, "head_dim": 40, "rotary_dim": 24, "is_neox": False}
    impl = ROTARY_EMBEDDING.implementations["triton"]
    configs = impl.configs(shape, torch.float32)
    by_block = {c["BLOCK_H"]: c for c in configs}  # one per block size (the tiling changes, warps do not)
    assert len(by_block) >= 3, configs
    for config in by_block.values():
        pinned = Implementation("pinned", functools.partial(impl.fn, config=config))
        spec = dataclasses.replace(ROTARY_EMBEDDING, implementations={"pinned": pinned})
        case = run_case(spec, "pinned", shape, torch.float32, device, seed=_seed())
        assert case.passed, (config, case)


def test_rotary_embedding_rejects_a_malformed_config(device):
    impl = ROTARY_EMBEDDING.implementations["triton"]
    inputs = ROTARY_EMBEDDING.make_inputs(
        {"tokens": 3, "q_heads": 7, "kv_heads": 3, "head_dim": 40, "rotary_dim": 24, "is_neox": False},
        torch.float32,
        device,
        torch.Generator().manual_seed(0),
    )
    with pytest.raises(ValueError, match="rotary_embedding: config .* needs BLOCK_H a power of two"):
        impl.fn(**inputs, config={"BLOCK_H": 48, "num_warps": 4})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [
        {"tokens": 33, "q_heads": 32, "kv_heads": 8, "head_dim": 128},
        {"tokens": 5, "q_heads": 7, "kv_heads": 1, "head_dim": 80, "rotary_dim": 34, "is_neox": False},
    ],
)
def test_rotary_embedding_bfloat16_on_gpu(shape):
    case = run_case(ROTARY_EMBEDDING, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=_seed())
    assert case.passed, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim, rotary_dim, is_neox", [(64, 64, True), (80, 34, False), (96, 48, True)])
def test_cpu_rotary_embedding_compiled_by_inductor_equals_eager_in_place_and_returned(
    dtype, head_dim, rotary_dim, is_neox
):
    """The in-graph form (cpu._rotary_in_graph) through inductor, on views into one fused QKV buffer as
    the attention layer passes them: the returned heads and the heads written in place both equal the
    eager implementation's, and the V part of the buffer is left as it was."""
    g = torch.Generator().manual_seed(7)
    tokens, q_heads, kv_heads = 5, 6, 2
    sizes = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    cache = kiln.ops.rope_cos_sin_cache(rotary_dim, 64, 10000.0, None, torch.float32, None)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    qkv = torch.randn(tokens, sum(sizes), generator=g).to(dtype)

    def rotate(positions, qkv):
        q, k, v = qkv.split(sizes, dim=-1)
        q = q.view(tokens, q_heads, head_dim)
        k = k.view(tokens, kv_heads, head_dim)
        q_out, k_out = kiln.ops.rotary_embedding(positions, q, k, cache, is_neox)
        return q_out * 1.0, k_out * 1.0, v * 1.0  # new tensors: what later ops of the graph read

    eager_qkv, compiled_qkv = qkv.clone(), qkv.clone()
    with torch.no_grad():
        eager = rotate(positions, eager_qkv)
        torch._dynamo.reset()
        compiled = torch.compile(rotate, fullgraph=True)(positions, compiled_qkv)
    tol = {torch.float32: 1e-6, torch.bfloat16: 8e-3}[dtype]
    for name, got, want in zip(("q", "k", "v"), compiled, eager, strict=True):
        assert not got.isnan().any()
        assert_close(got.float(), want.float(), tol, f"returned {name}")
    assert_close(compiled_qkv.float(), eager_qkv.float(), tol, "the QKV buffer written in place")
    v_start = sizes[0] + sizes[1]
    assert torch.equal(compiled_qkv[:, v_start:], qkv[:, v_start:])
