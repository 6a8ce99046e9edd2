import dataclasses
import random
import re

import pytest
import torch

import kiln.ops
from kiln.ops.alloc import poisoned
from kiln.ops.moe.fused_moe import FUSED_MOE, quantize_experts_fp8
from kiln.ops.moe.fused_moe import triton as moe_triton
from kiln.ops.moe.fused_moe.spec import fused_moe_reference
from kiln.ops.moe.fused_moe.triton import fused_moe_triton
from kiln.ops.registry import Implementation, trusted_inputs
from kiln.verify import assert_close, run_case

SHAPES = [
    {"tokens": 1, "hidden": 64, "intermediate": 48, "experts": 8, "top_k": 2},  # decode: one token
    {"tokens": 1, "hidden": 40, "intermediate": 24, "experts": 4, "top_k": 1},
    {"tokens": 23, "hidden": 37, "intermediate": 19, "experts": 6, "top_k": 2, "skew": 1.5},  # uneven
    {"tokens": 5, "hidden": 72, "intermediate": 33, "experts": 8, "top_k": 8},  # all experts per token
    {"tokens": 45, "hidden": 48, "intermediate": 40, "experts": 3, "top_k": 1},  # > BLOCK_M per expert
]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", [False, True], ids=["same_dtype_weights", "fp8_weights"])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_float64_reference(backend, dtype, fp8, shape, device):
    case = run_case(FUSED_MOE, backend, {**shape, "fp8": fp8}, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_cpu_bfloat16(fp8):
    shape = {
        "tokens": 17,
        "hidden": 64,
        "intermediate": 40,
        "experts": 4,
        "top_k": 2,
        "skew": 1.0,
        "fp8": fp8,
    }
    case = run_case(
        FUSED_MOE, "cpu", shape, torch.bfloat16, torch.device("cpu"), seed=random.randrange(2**31)
    )
    assert case.passed, case


def _inputs(tokens, hidden, inter, experts, top_k, dtype, device, seed):
    shape = {"tokens": tokens, "hidden": hidden, "intermediate": inter, "experts": experts, "top_k": top_k}
    return FUSED_MOE.make_inputs(shape, dtype, device, torch.Generator().manual_seed(seed))


def test_fused_moe_experts_with_zero_tokens_and_duplicate_routing_weights(device):
    inputs = _inputs(9, 40, 24, 6, 2, torch.float32, device, seed=11)
    # Only experts 0, 2 and 5 are used; 1, 3 and 4 get no tokens at all.
    choices = torch.tensor([[0, 2], [2, 5], [5, 0]], dtype=torch.int32)
    inputs["topk_ids"] = choices[torch.arange(9) % 3].to(device)
    got = fused_moe_triton(**inputs)
    assert_close(got, fused_moe_reference(**inputs), 2e-5)


def test_fused_moe_all_tokens_on_one_expert_spans_several_m_blocks(device):
    inputs = _inputs(50, 33, 21, 4, 1, torch.float16, device, seed=12)
    inputs["topk_ids"] = torch.full((50, 1), 3, dtype=torch.int32, device=device)
    ref = fused_moe_reference(
        **{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    )
    assert_close(fused_moe_triton(**inputs), ref, 2e-3)


@pytest.mark.parametrize("group_m", [1, 3])
def test_fused_moe_grouped_program_order_covers_every_tile(group_m, device):
    # Small tiles: several N-blocks and M-blocks, with a partial last group of M-blocks.
    config = {
        "BLOCK_M": 16,
        "BLOCK_N": 16,
        "BLOCK_K": 16,
        "GROUP_M": group_m,
        "num_warps": 2,
        "num_stages": 1,
    }
    inputs = _inputs(30, 50, 35, 5, 2, torch.float32, device, seed=13)
    inputs["topk_ids"] = torch.stack([torch.arange(30) % 2, 2 + torch.arange(30) % 3], 1).int().to(device)
    assert_close(fused_moe_triton(**inputs, config=config), fused_moe_reference(**inputs), 2e-5)


def test_fused_moe_runs_in_token_chunks_when_offsets_would_overflow_32_bits(device, monkeypatch):
    monkeypatch.setattr(moe_triton, "INT32_LIMIT", 5000)  # -> 62-token chunks for this shape
    inputs = _inputs(130, 40, 24, 4, 2, torch.float32, device, seed=14)
    assert_close(fused_moe_triton(**inputs), fused_moe_reference(**inputs), 2e-5)
    monkeypatch.setattr(moe_triton, "INT32_LIMIT", 1000)
    with pytest.raises(ValueError, match="32-bit offsets"):
        fused_moe_triton(**inputs)


def test_fused_moe_public_function_routes_then_mixes(device, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(7, 32, device=device)
    w_gate_up = torch.randn(4, 2 * 24, 32, device=device) / 32**0.5
    w_down = torch.randn(4, 32, 24, device=device) / 24**0.5
    weights, ids = kiln.ops.moe_route(torch.randn(7, 4, device=device), 2)
    expected = fused_moe_reference(x, w_gate_up, w_down, weights, ids)
    for backend in ("triton", "cpu"):
        monkeypatch.setenv("KILN_BACKEND", backend)
        assert_close(kiln.ops.fused_moe(x, w_gate_up, w_down, weights, ids), expected, 2e-5, backend)


def test_fused_moe_verifier_catches_missing_routing_weights():
    def unweighted(x, w_gate_up, w_down, topk_weights, topk_ids, w_gate_up_scale=None, w_down_scale=None):
        return fused_moe_reference(x, w_gate_up, w_down, torch.ones_like(topk_weights), topk_ids)

    spec = dataclasses.replace(FUSED_MOE, implementations={})
    spec.register(Implementation("planted", unweighted))
    shape = {"tokens": 6, "hidden": 16, "intermediate": 16, "experts": 4, "top_k": 2}
    case = run_case(spec, "planted", shape, torch.float32, torch.device("cpu"), seed=4)
    assert not case.passed


def test_quantize_experts_fp8_roundtrip_is_close():
    w = torch.randn(3, 20, 30)
    w8, scale = quantize_experts_fp8(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (3,)
    assert_close(w8.float() * scale[:, None, None], w, 0.05, "e4m3 keeps 3 mantissa bits")


def _bad(**overrides):
    args = {
        "x": torch.randn(4, 16),
        "w_gate_up": torch.randn(3, 2 * 8, 16),
        "w_down": torch.randn(3, 16, 8),
        "topk_weights": torch.rand(4, 2),
        "topk_ids": torch.randint(0, 3, (4, 2), dtype=torch.int32),
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "args, message",
    [
        (_bad(x=torch.randn(4, 15)), "w_gate_up has in-features 16, expected x's hidden size 15"),
        (_bad(w_gate_up=torch.randn(3, 15, 16)), "expected 2 \\* intermediate"),
        (_bad(w_down=torch.randn(3, 16, 9)), "w_down has shape \\(3, 16, 9\\), expected"),
        (_bad(w_down=torch.randn(2, 16, 8)), "w_down has shape"),
        (_bad(w_gate_up=torch.randn(3, 16, 16, dtype=torch.float16)), "w_gate_up has dtype float16"),
        (_bad(w_gate_up=torch.randn(3, 16, 16).to(torch.float8_e4m3fn)), "pass w_gate_up_scale"),
        (_bad(w_down_scale=torch.ones(3)), "w_down_scale is only for float8_e4m3fn weights"),
        (_bad(topk_ids=torch.randint(0, 3, (5, 2))), "must both be \\[num_tokens=4, top_k\\]"),
        (_bad(topk_ids=torch.full((4, 2), 3)), "topk_ids has values in \\[3, 3\\], expected \\[0, 3\\)"),
        (_bad(topk_ids=torch.rand(4, 2)), "topk_ids has dtype float32"),
    ],
)
def test_fused_moe_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.fused_moe(**args)


@pytest.mark.parametrize("bad_id", [-1, 3, 2**31 - 1])
def test_fused_moe_rejects_out_of_range_expert_ids_on_every_device(bad_id, device):
    # Range-checked with one fused min/max on any device (CPU tensors only, before).
    topk_ids = torch.tensor([[0, 1], [1, 2], [2, bad_id], [0, 2]], dtype=torch.int32)
    args = {name: value.to(device) for name, value in _bad(topk_ids=topk_ids).items()}
    low, high = min(bad_id, 0), max(bad_id, 2)
    message = re.escape(f"fused_moe: topk_ids has values in [{low}, {high}], expected [0, 3)")
    with pytest.raises(ValueError, match=message):
        kiln.ops.fused_moe(**args)
    with pytest.raises(ValueError, match="topk_ids has values in"):
        torch.ops.kiln.fused_moe(*args.values())


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize(
    "backend, align", [("triton", "one_program"), ("triton", "torch_ops"), ("cpu", None)]
)
def test_fused_moe_unchecked_out_of_range_expert_ids_add_nothing_and_spare_other_tokens(
    backend, align, top_k, ids_dtype, device, monkeypatch
):
    """Inside trusted_inputs() the ids are not checked: a bad one must neither read past the expert
    weights nor disturb another token's pairs (it used to land on the GEMM's first slot); its pair
    adds nothing, as in the reference. Poisoned outputs catch rows left unwritten."""
    device = torch.device("cpu") if backend == "cpu" else device
    monkeypatch.setenv("KILN_BACKEND", backend)
    if align == "torch_ops":
        monkeypatch.setattr(moe_triton, "fits_single_program", lambda num_pairs, num_experts: False)
    inputs = _inputs(9, 40, 24, 5, top_k, torch.float32, device, seed=15)
    # 5 experts: the one-program alignment's one-hot has 8 columns, so 5 and 7 fall inside it,
    # 8 and 2**31 - 1 past it; 2**32 + 1 would wrap to expert 1 if narrowed to int32.
    bad = [-1, 5, 7, 8, 2**31 - 1] + ([2**32 + 1] if ids_dtype == torch.int64 else [])
    topk_ids = inputs["topk_ids"].to(ids_dtype)
    for token, bad_id in enumerate(bad, start=1):  # token 0 (pair 0) keeps its valid experts
        topk_ids[token, token % top_k] = bad_id
    inputs["topk_ids"] = topk_ids
    with trusted_inputs(), poisoned():
        got = kiln.ops.fused_moe(**inputs)
    expected = fused_moe_reference(**inputs)  # counts only the experts that exist
    assert_close(got, expected, 2e-5, backend)
    if top_k == 1:
        assert torch.count_nonzero(got[1 : len(bad) + 1]) == 0


def test_fused_moe_rejects_fp8_scale_of_wrong_length():
    w8, _ = quantize_experts_fp8(torch.randn(3, 16, 16))
    with pytest.raises(ValueError, match="w_gate_up_scale has 2 entries, expected num_experts 3"):
        kiln.ops.fused_moe(**_bad(w_gate_up=w8, w_gate_up_scale=torch.ones(2)))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_moe_bfloat16_on_gpu(tokens, fp8):
    shape = {"tokens": tokens, "hidden": 256, "intermediate": 320, "experts": 8, "top_k": 2, "fp8": fp8}
    case = run_case(
        FUSED_MOE, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=random.randrange(2**31)
    )
    assert case.passed, case


@pytest.mark.gpu
def test_fused_moe_bfloat16_mixtral_layer_on_gpu():
    shape = {"tokens": 33, "hidden": 4096, "intermediate": 14336, "experts": 8, "top_k": 2}
    case = run_case(
        FUSED_MOE, "triton", shape, torch.bfloat16, torch.device("cuda"), seed=random.randrange(2**31)
    )
    assert case.passed, case
