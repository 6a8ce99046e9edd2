"""Kiln's native causal attention for one sequence on the CPU (kiln_cpu.causal_attention, the prefill
attention of paged_prefill_attention's and flash_attention's CPU paths) against a float64 reference:
odd lengths, GQA ratios, chunked prefill (queries at the end of longer keys), sliding windows; keys
past a query's position never reach its output; malformed inputs are refused by name."""

import math

import pytest
import torch

from kiln.ops.attention import cpu_sdpa
from kiln.ops.attention.reference import attend_one_sequence
from kiln.verify import assert_close

pytestmark = pytest.mark.skipif(
    not cpu_sdpa.native_causal_ready(64), reason="Kiln's native CPU library is not built here"
)


def _reference(q, k, v, scale, window):
    """float64 causal attention (bottom-right aligned): the ops' own reference."""
    return attend_one_sequence(q.double(), k.double(), v.double(), scale, True, window, None)[0]


CASES = [
    # (Lq, Lk, H, Hkv, D, window): SmolLM2's prefill; one token; chunks after a prefix; MHA, 4:1 and 8:1
    # GQA; windows narrower than a query block, of one key, wider than the sequence
    (270, 270, 9, 3, 64, None),
    (1, 1, 4, 4, 16, None),
    (1, 37, 8, 2, 32, None),
    (5, 17, 8, 2, 32, None),
    (33, 100, 6, 3, 128, 7),
    (77, 77, 4, 1, 80, 20),
    (130, 300, 12, 4, 64, None),
    (40, 40, 8, 1, 48, 1),
    (9, 23, 3, 3, 96, 500),
]


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(str(d) for d in s))
def test_native_causal_attention_matches_float64(shape):
    lq, lk, heads, kv_heads, head_dim, window = shape
    if not cpu_sdpa.native_causal_ready(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a multiple of this build's vector width")
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    q = torch.randn(lq, heads, head_dim, generator=g)
    k, v = (torch.randn(lk, kv_heads, head_dim, generator=g) for _ in range(2))
    scale = 0.7 / math.sqrt(head_dim)
    out = cpu_sdpa.attend_native_causal(q, k, v, scale, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    # float32 products and sums over at most a few hundred keys
    assert_close(out, _reference(q, k, v, scale, window), 2e-6, f"{shape}")


def test_keys_past_a_query_never_reach_it_and_nan_stays_in_its_rows():
    lq, lk, heads, kv_heads, head_dim = 24, 40, 6, 2, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(lq, heads, head_dim, generator=g)
    k, v = (torch.randn(lk, kv_heads, head_dim, generator=g) for _ in range(2))
    k[-1], v[-1] = math.nan, math.inf  # the last key: only the last query sees it
    q[5, 4] = math.nan  # one query row of head 4
    out = cpu_sdpa.attend_native_causal(q, k, v, head_dim**-0.5, None)
    assert torch.isnan(out[-1]).all()
    assert torch.isnan(out[5, 4]).all()
    finite = torch.ones(lq, heads, dtype=torch.bool)
    finite[-1] = False
    finite[5, 4] = False
    assert torch.isfinite(out[finite]).all()
    k[-1], v[-1] = k[-2], v[-2]
    q[5, 4] = q[5, 3]
    clean = cpu_sdpa.attend_native_causal(q, k, v, head_dim**-0.5, None)
    assert torch.equal(out[finite], clean[finite])  # the other rows' floats did not move either
    # the first key NaN: every query sees it, except through a window of 10 (positions 16.. see 7..)
    k[0] = math.nan
    assert torch.isnan(cpu_sdpa.attend_native_causal(q, k, v, head_dim**-0.5, None)).all()
    assert torch.isfinite(cpu_sdpa.attend_native_causal(q, k, v, head_dim**-0.5, 10)).all()


def test_attend_sequence_takes_the_native_kernel_for_causal_float_inputs(monkeypatch):
    calls = []
    native = cpu_sdpa.attend_native_causal

    def counted(*args):
        calls.append(args[0].shape)
        return native(*args)

    monkeypatch.setattr(cpu_sdpa, "attend_native_causal", counted)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(11, 4, 64, generator=g)
    k, v = (torch.randn(19, 2, 64, generator=g) for _ in range(2))
    expected = _reference(q, k, v, 0.125, None)
    for dtype in (torch.float32, torch.bfloat16):
        out, lse = cpu_sdpa.attend_sequence(
            q.to(dtype), k.to(dtype), v.to(dtype), 0.125, True, None, None, False
        )
        assert lse is None and out.dtype == dtype
        assert_close(out, expected, 2e-6 if dtype == torch.float32 else 2e-2, f"{dtype}")
    assert calls == [q.shape, q.shape]
    # not causal, soft-capped or asking for the LSE: the other paths
    cpu_sdpa.attend_sequence(q, k, v, 0.125, False, None, None, False)
    cpu_sdpa.attend_sequence(q, k, v, 0.125, True, None, 5.0, False)
    cpu_sdpa.attend_sequence(q, k, v, 0.125, True, None, None, True)
    with cpu_sdpa.without_native():  # the benchmarks' SDPA baselines
        out, _ = cpu_sdpa.attend_sequence(q, k, v, 0.125, True, None, None, False)
    assert_close(out, expected, 2e-6, "SDPA")
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("q", "k", "v", "message"),
    [
        ((4, 2, 64), (4, 2, 64), (4, 2, 64), "float32"),  # q as float64 below
        ((4, 2, 64), (3, 2, 64), (3, 2, 64), "must be >= Lq"),
        ((4, 3, 64), (4, 2, 64), (4, 2, 64), "multiple of kv heads"),
        ((4, 2, 64), (4, 2, 64), (4, 2, 32), "k and v must be"),
        ((4, 2, 64), (4, 2, 32), (4, 2, 32), "k and v must be"),
        ((4, 2, 12), (4, 2, 12), (4, 2, 12), "head_dim 12"),
    ],
)
def test_native_causal_attention_refuses_malformed_inputs_by_name(q, k, v, message):
    dtype = torch.float64 if message == "float32" else torch.float32
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kiln_cpu.causal_attention(
            torch.randn(q, dtype=dtype), torch.randn(k), torch.randn(v), 0.1, -1
        )
