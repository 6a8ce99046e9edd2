import random

import pytest
import torch
import torch.nn.functional as F

import kiln.ops
from kiln.ops.attention.flash_attention import FLASH_ATTENTION, FLASH_ATTENTION_WITH_LSE
from kiln.ops.attention.reference import attend_one_sequence
from kiln.verify import assert_close, run_case

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}

# (op, shape): the LSE cases run the op that returns it, flash_attention_with_lse.
CASES = [
    # single tokens; lengths not multiples of the tile; k_len > q_len (bottom-right causal)
    (FLASH_ATTENTION,
     {"seqlens_q": [1, 1], "seqlens_k": [1, 9], "num_heads": 2, "num_kv_heads": 2, "head_dim": 64}),
    (FLASH_ATTENTION_WITH_LSE,
     {"seqlens_q": [37, 5, 1], "seqlens_k": [37, 21, 19], "num_heads": 4, "num_kv_heads": 1, "head_dim": 64}),
    (FLASH_ATTENTION,
     {"seqlens_q": [33], "seqlens_k": [33], "num_heads": 8, "num_kv_heads": 1, "head_dim": 80}),
    (FLASH_ATTENTION_WITH_LSE,
     {"seqlens_q": [29], "seqlens_k": [45], "num_heads": 4, "num_kv_heads": 2, "head_dim": 96,
      "sliding_window": 7, "softcap": 5.0}),
    (FLASH_ATTENTION_WITH_LSE,
     {"seqlens_q": [18, 33], "seqlens_k": [40, 33], "num_heads": 3, "num_kv_heads": 3, "head_dim": 128,
      "causal": False}),
    # more queries than keys: the first 13 queries of sequence 0 see no key (out 0, lse -inf)
    (FLASH_ATTENTION_WITH_LSE,
     {"seqlens_q": [20, 5], "seqlens_k": [7, 5], "num_heads": 2, "num_kv_heads": 1, "head_dim": 64}),
]  # fmt: skip
CASE_IDS = [f"{spec.name}-{i}" for i, (spec, _) in enumerate(CASES)]


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec, shape", CASES, ids=CASE_IDS)
def test_flash_attention_matches_float64_reference(backend, dtype, spec, shape, device):
    case = run_case(spec, backend, shape, dtype, device, seed=random.randrange(2**31))
    assert case.passed, case


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_flash_attention_head_dims_cover_the_extremes(backend, head_dim, device):
    shape = {"seqlens_q": [19], "seqlens_k": [19], "num_heads": 2, "num_kv_heads": 1, "head_dim": head_dim}
    case = run_case(FLASH_ATTENTION, backend, shape, torch.float16, device, seed=random.randrange(2**31))
    assert case.passed, case


def _varlen(device, lens, heads, kv_heads, head_dim, dtype=torch.float16):
    total = sum(lens)
    q = torch.randn(total, heads, head_dim, device=device).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, device=device).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, device=device).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_flash_attention_agrees_with_torch_sdpa_for_gqa_ratios(backend, group, device, monkeypatch):
    """torch's SDPA is a second, independent witness (per sequence, kv heads expanded)."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    lens = [23, 1, 40]
    q, k, v, cu = _varlen(device, lens, 8, 8 // group, 64)
    out = kiln.ops.flash_attention(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for b in range(len(lens)):
        s, e = cu[b].item(), cu[b + 1].item()
        qs, ks, vs = (t[s:e].transpose(0, 1).float() for t in (q, k, v))
        expected = F.scaled_dot_product_attention(
            qs, ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0), is_causal=True
        )
        assert_close(out[s:e].transpose(0, 1), expected, TOL[torch.float16], f"sequence {b}")


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_flash_attention_lse_is_logsumexp_of_scaled_scores(backend, device, monkeypatch):
    monkeypatch.setenv("KILN_BACKEND", backend)
    lens = [17, 30]
    q, k, v, cu = _varlen(device, lens, 4, 2, 64, torch.float32)
    _, lse = kiln.ops.flash_attention(q, k, v, cu, cu, 30, 30, causal=True, scale=0.1, return_lse=True)
    assert lse.shape == (4, sum(lens)) and lse.dtype == torch.float32
    for b in range(2):
        s, e = cu[b].item(), cu[b + 1].item()
        scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e].repeat_interleave(2, 1)) * 0.1
        scores = scores.masked_fill(
            torch.ones(e - s, e - s, dtype=torch.bool, device=device).triu(1), -torch.inf
        )
        assert_close(lse[:, s:e], torch.logsumexp(scores, -1), 1e-6, f"lse of sequence {b}")


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_return_lse_calls_flash_attention_with_lse_and_agrees_with_flash_attention(
    backend, device, monkeypatch
):
    """kiln.ops.flash_attention keeps its return_lse flag: False is the op flash_attention, True the op
    flash_attention_with_lse (whose out is flash_attention's; the CPU path computes it another way)."""
    monkeypatch.setenv("KILN_BACKEND", backend)
    q, k, v, cu = _varlen(device, [9, 20], 4, 2, 64, torch.float32)
    out = kiln.ops.flash_attention(q, k, v, cu, cu, 20, 20)
    out_lse, lse = kiln.ops.flash_attention(q, k, v, cu, cu, 20, 20, return_lse=True)
    direct_out, direct_lse = kiln.ops.flash_attention_with_lse(q, k, v, cu, cu, 20, 20)
    assert torch.equal(out_lse, direct_out) and torch.equal(lse, direct_lse)
    assert_close(out_lse, out, TOL[torch.float32])
    assert torch.equal(torch.ops.kiln.flash_attention(q, k, v, cu, cu, 20, 20), out)


def test_flash_attention_never_loads_key_tiles_outside_the_window(device, monkeypatch):
    """Keys 0..31 are before every query's window: NaN there must not reach the output, which it
    would if a masked tile were loaded (0 * NaN = NaN). Keys 32..40 share a tile with visible keys
    and stay finite."""
    monkeypatch.setenv("KILN_BACKEND", "triton")
    q = torch.randn(16, 2, 64, device=device)
    k = torch.randn(64, 2, 64, device=device)
    v = torch.randn(64, 2, 64, device=device)
    cu_q = torch.tensor([0, 16], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 64], dtype=torch.int32, device=device)
    expected, _ = attend_one_sequence(q.double(), k.double(), v.double(), None, True, 8, None)
    k[:32], v[:32] = float("nan"), float("nan")
    out = kiln.ops.flash_attention(q, k, v, cu_q, cu_k, 16, 64, causal=True, sliding_window=8)
    assert_close(out, expected, TOL[torch.float32])


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # rows past 16 do see the NaN keys
def test_flash_attention_causal_never_loads_future_tiles(device, monkeypatch):
    """With q_len == k_len, the first query tile must not load keys of later tiles."""
    monkeypatch.setenv("KILN_BACKEND", "triton")
    q, k, v, cu = _varlen(device, [40], 2, 2, 64, torch.float32)
    expected, _ = attend_one_sequence(
        q[:16].double(), k[:16].double(), v[:16].double(), None, True, None, None
    )
    k[16:], v[16:] = float("nan"), float("nan")
    out = kiln.ops.flash_attention(q, k, v, cu, cu, 40, 40, causal=True)
    assert_close(out[:16], expected, TOL[torch.float32])  # rows 16.. see the NaN keys; not checked


def _args(**overrides):
    q, k, v, cu = _varlen(torch.device("cpu"), [5, 7], 4, 2, 64)
    args = {
        "q": q,
        "k": k,
        "v": v,
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu,
        "max_seqlen_q": 7,
        "max_seqlen_k": 7,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"q": torch.randn(12, 3, 64).half()}, "not a multiple of the 2 kv heads"),
        ({"q": torch.randn(12, 4, 48).half()}, "head_dim 48, supported head dims"),
        ({"k": torch.randn(12, 2, 64)}, "k has dtype float32"),
        ({"v": torch.randn(12, 2, 64).half()[:11]}, "v has shape"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 12])}, "cu_seqlens_q has dtype int64"),
        ({"cu_seqlens_k": torch.tensor([0, 12], dtype=torch.int32)}, "cu_seqlens_k has 2 entries"),
        ({"cu_seqlens_q": torch.tensor([0, 5, 11], dtype=torch.int32)}, "ends at 11"),
        ({"max_seqlen_q": 6}, "above max_seqlen 6"),
        ({"sliding_window": 0}, "sliding_window must be positive"),
        ({"softcap": -1.0}, "softcap must be positive"),
    ],
)
def test_flash_attention_rejects_bad_input(overrides, message):
    with pytest.raises(ValueError, match=message):
        kiln.ops.flash_attention(**_args(**overrides))


@pytest.mark.gpu
@pytest.mark.parametrize("spec, shape", CASES, ids=CASE_IDS)
def test_flash_attention_bfloat16_on_gpu(spec, shape):
    case = run_case(spec, "triton", shape, torch.bfloat16, torch.device("cuda"), random.randrange(2**31))
    assert case.passed, case


@pytest.mark.gpu
def test_flash_attention_long_causal_prefill_on_gpu():
    shape = {
        "batch": 2,
        "seqlen_q": 2000,
        "seqlen_k": 2000,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 128,
    }
    for dtype in (torch.float16, torch.bfloat16):
        case = run_case(
            FLASH_ATTENTION, "triton", shape, dtype, torch.device("cuda"), random.randrange(2**31)
        )
        assert case.passed, case


def test_a_sequence_without_keys_is_verifiable_zero_output_and_minus_inf_lse():
    """The reference raised on an empty key range (amax of an empty row); the CPU path's answer for
    it (0, -inf) could not be checked."""
    q, k, v = torch.randn(5, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 0, 3], dtype=torch.int32)
    ref_out, ref_lse = FLASH_ATTENTION_WITH_LSE.reference(
        q.double(), k.double(), v.double(), cu_q, cu_k, 3, 3, False
    )
    out, lse = kiln.ops.flash_attention_with_lse(q, k, v, cu_q, cu_k, 3, 3, causal=False)
    assert torch.equal(ref_out[:2], torch.zeros_like(ref_out[:2])) and bool(torch.isinf(ref_lse[:, :2]).all())
    assert_close(out, ref_out, 1e-5)
    assert_close(lse, ref_lse, 1e-5)
