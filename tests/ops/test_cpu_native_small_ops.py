"""The native CPU kernels of the eager decode path's small ops (kiln_cpu.rms_norm, rotary_embedding_,
silu_and_mul, gelu_tanh_and_mul, write_kv_cache; kiln.ops.native_cpu): through kiln.ops they must be
what runs for float32 (the profiler sees the native op), agree with the float64 references and with
the PyTorch forms they replace (the same functions with the library marked unavailable), keep NaN, and refuse
malformed inputs by name. Shapes are odd on purpose: views into a fused QKV row, partial rotary,
GPT-J pairs, padding slots, rows past the vector width."""

import random

import pytest
import torch

import kiln.ops
from kiln.ops import native_cpu
from kiln.ops.activation.gelu_tanh_and_mul.spec import gelu_tanh_and_mul_reference
from kiln.ops.activation.silu_and_mul.spec import silu_and_mul_reference
from kiln.ops.attention.write_kv_cache.spec import write_kv_cache_reference
from kiln.ops.norm.rms_norm.spec import rms_norm_reference
from kiln.ops.rope.cache import rope_cos_sin_cache
from kiln.ops.rope.rotary_embedding.spec import rotary_embedding_reference
from kiln.verify import assert_close

TOL = 2e-6  # float32 arithmetic; only the order of the sums differs from the references


@pytest.fixture(scope="module")
def native():
    if not native_cpu.load():
        pytest.skip("Kiln's native CPU library could not be built here (no C++ compiler or ninja)")


@pytest.fixture
def torch_forms(monkeypatch):
    """Run a block with the library marked unavailable: the ops take their PyTorch forms."""

    class Forms:
        def __enter__(self):
            monkeypatch.setitem(native_cpu._state, "loaded", False)

        def __exit__(self, *exc):
            monkeypatch.undo()

    return Forms()


def _runs(op_name: str, fn) -> bool:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return any(event.name == f"kiln_cpu::{op_name}" for event in prof.events())


def _gen():
    return torch.Generator().manual_seed(random.randrange(2**31))


@pytest.mark.parametrize("tokens,hidden,offset", [(1, 576, 0.0), (5, 77, 1.0), (33, 8, 0.0)])
def test_rms_norm_native_matches_reference_and_torch_form(tokens, hidden, offset, native, torch_forms):
    g = _gen()
    x, weight = torch.randn(tokens, hidden, generator=g), torch.rand(hidden, generator=g) + 0.5
    residual = torch.randn(tokens, hidden, generator=g)
    assert _runs("rms_norm", lambda: kiln.ops.rms_norm(x, weight, 1e-5, weight_offset=offset))
    y = kiln.ops.rms_norm(x, weight, 1e-5, weight_offset=offset)
    assert_close(y, rms_norm_reference(x.double(), weight.double(), 1e-5, None, offset), TOL, "plain")
    ref_residual = residual.double().clone()
    ref = rms_norm_reference(x.double(), weight.double(), 1e-5, ref_residual, offset)[0]
    native_residual = residual.clone()
    y, written = kiln.ops.rms_norm(x, weight, 1e-5, native_residual, weight_offset=offset)
    assert written is native_residual  # written in place, as the contract says
    assert_close(y, ref, TOL, "with residual")
    assert_close(native_residual, ref_residual, TOL, "residual written back")
    with torch_forms:
        torch_residual = residual.clone()
        y_torch, _ = kiln.ops.rms_norm(x, weight, 1e-5, torch_residual, weight_offset=offset)
    assert_close(y, y_torch.double(), TOL, "against the PyTorch form")
    assert torch.equal(native_residual, torch_residual)  # one float32 add either way
    x[0, hidden // 2] = float("nan")
    y = kiln.ops.rms_norm(x, weight, 1e-5)
    assert torch.isnan(y[0]).all() and not torch.isnan(y[1:]).any()


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary_dim", [(1, 9, 3, 64, 64), (7, 4, 1, 80, 40)])
def test_rotary_native_rotates_views_in_place_like_reference(
    tokens, heads, kv_heads, head_dim, rotary_dim, is_neox, native, torch_forms
):
    g = _gen()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, generator=g)  # q and k: strided views of one row
    cache = rope_cos_sin_cache(rotary_dim, 512, 10000.0)
    positions = torch.randint(0, 512, (tokens,), generator=g)

    def views(buffer):
        return (buffer[:, :q_size].view(tokens, heads, head_dim),
                buffer[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim))  # fmt: skip

    ref_q, ref_k = (t.double().clone() for t in views(qkv))
    rotary_embedding_reference(positions, ref_q, ref_k, cache.double(), is_neox)
    native_buffer, torch_buffer = qkv.clone(), qkv.clone()
    q, k = views(native_buffer)
    rotate_copy = lambda: kiln.ops.rotary_embedding(positions, *views(qkv.clone()), cache, is_neox)  # noqa: E731
    assert _runs("rotary_embedding_", rotate_copy)
    kiln.ops.rotary_embedding(positions, q, k, cache, is_neox)
    assert_close(q, ref_q, TOL, "q")
    assert_close(k, ref_k, TOL, "k")
    assert torch.equal(native_buffer[:, q_size + kv_size :], qkv[:, q_size + kv_size :])  # v untouched
    with torch_forms:
        kiln.ops.rotary_embedding(positions, *views(torch_buffer), cache, is_neox)
    assert_close(native_buffer, torch_buffer.double(), TOL, "against the PyTorch form")


@pytest.mark.parametrize("shape", [(1, 3072), (3, 5, 18), (2, 2)])
def test_silu_and_mul_native_matches_reference_and_torch_form(shape, native, torch_forms):
    x = torch.randn(*shape, generator=_gen()) * 4
    assert _runs("silu_and_mul", lambda: kiln.ops.silu_and_mul(x))
    y = kiln.ops.silu_and_mul(x)
    assert_close(y, silu_and_mul_reference(x.double()), TOL, "silu_and_mul")
    with torch_forms:
        assert_close(y, kiln.ops.silu_and_mul(x).double(), TOL, "against the PyTorch form")
    x[..., 0] = float("nan")
    assert torch.isnan(kiln.ops.silu_and_mul(x)[..., 0]).all()


@pytest.mark.parametrize("shape", [(1, 4096), (3, 5, 18), (2, 2)])  # Gemma 3 270M's 2 x 2048, odd tails
def test_gelu_tanh_and_mul_native_matches_reference_and_torch_form(shape, native, torch_forms):
    x = torch.randn(*shape, generator=_gen()) * 4
    x[..., 0] = -12.0  # deep in the negative tail, where 1 + tanh(z) would cancel
    assert _runs("gelu_tanh_and_mul", lambda: kiln.ops.gelu_tanh_and_mul(x))
    y = torch.full(x[..., : shape[-1] // 2].shape, float("nan"))
    y.copy_(kiln.ops.gelu_tanh_and_mul(x))
    assert_close(y, gelu_tanh_and_mul_reference(x.double()), TOL, "gelu_tanh_and_mul")
    with torch_forms:
        assert_close(y, kiln.ops.gelu_tanh_and_mul(x).double(), TOL, "against the PyTorch form")
    x[..., 0] = float("nan")
    assert torch.isnan(kiln.ops.gelu_tanh_and_mul(x)[..., 0]).all()


def test_write_kv_cache_native_writes_views_and_skips_padding(native, torch_forms):
    g = _gen()
    tokens, kv_heads, head_dim, num_blocks, block_size = 6, 3, 40, 5, 4
    qkv = torch.randn(tokens, (1 + 2 * kv_heads) * head_dim, generator=g)
    key = qkv[:, head_dim : head_dim * (1 + kv_heads)].view(tokens, kv_heads, head_dim)
    value = qkv[:, head_dim * (1 + kv_heads) :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, -1, 17, 0, -1, 19])  # padding rows among them, the last slot of the cache
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan")) for _ in range(6)]  # poisoned: only the slots may change
    assert _runs("write_kv_cache", lambda: kiln.ops.write_kv_cache(key, value, caches[0], caches[1], slots))
    kiln.ops.write_kv_cache(key, value, caches[0], caches[1], slots)
    write_kv_cache_reference(key, value, caches[2], caches[3], slots)
    with torch_forms:
        kiln.ops.write_kv_cache(key, value, caches[4], caches[5], slots)
    for ours, ref, theirs in zip(caches[:2], caches[2:4], caches[4:], strict=True):
        assert torch.equal(ours.nan_to_num(7.0), ref.nan_to_num(7.0))
        assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    assert torch.isnan(caches[0].view(-1, kv_heads, head_dim)[1]).all()  # untouched slot still poisoned


def test_native_small_ops_refuse_malformed_inputs_by_name(native):
    ops = torch.ops.kiln_cpu
    x = torch.randn(2, 16)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[16\]"):
        ops.rms_norm(x, torch.ones(8), 1e-5, None, 0.0)
    with pytest.raises(RuntimeError, match=r"residual must be a contiguous float32 tensor shaped like x"):
        ops.rms_norm(x, torch.ones(16), 1e-5, torch.zeros(2, 32)[:, ::2], 0.0)
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match=r"position 40 of token 0 is outside the cos/sin cache's \[0, 32"):
        ops.rotary_embedding_(torch.tensor([40]), q, k, torch.randn(32, 8), True)
    with pytest.raises(RuntimeError, match=r"k must be float32 \[1, heads, head_dim >= rotary_dim\]"):
        ops.rotary_embedding_(torch.tensor([1]), q, torch.randn(1, 1, 4), torch.randn(32, 8), True)
    with pytest.raises(RuntimeError, match=r"x must be a float32 CPU tensor \[\.\.\., 2 \* d\]"):
        ops.silu_and_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match=r"gelu_tanh_and_mul: x must be a float32 CPU tensor"):
        ops.gelu_tanh_and_mul(torch.randn(2, 6, dtype=torch.float64))
    cache, one = torch.zeros(2, 4, 1, 8), torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match=r"slot 8 of token 0 is outside the cache's 8 slots"):
        ops.write_kv_cache(one, one, cache, cache.clone(), torch.tensor([8]))
    with pytest.raises(RuntimeError, match=r"key must be float32 \[T, 1, 8\]"):
        ops.write_kv_cache(torch.randn(1, 2, 8), one, cache, cache.clone(), torch.tensor([0]))
