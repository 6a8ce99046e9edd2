"""The verifier must be able to fail: wrong kernels, NaNs and unwritten outputs are caught."""

import dataclasses
import importlib.util
import math
import random

import torch

from kiln.ops import get_op
from kiln.ops.alloc import empty_like
from kiln.ops.registry import Implementation
from kiln.verify import relative_error, run_case
from kiln.verify.runner import verify

RMS_NORM = get_op("rms_norm")
SHAPE = {"rows": 6, "hidden": 301, "residual": True}


def spec_with(fn):
    spec = dataclasses.replace(RMS_NORM, implementations={})
    spec.register(Implementation("planted", fn))
    return spec


def test_verifier_passes_the_real_kernel(device):
    case = run_case(RMS_NORM, "triton", SHAPE, torch.float32, device, seed=1)
    assert case.passed and case.error < 1e-5


def test_verifier_catches_a_wrong_kernel(device):
    def wrong_eps(x, weight, eps=1e-6, residual=None):  # plausible bug: eps added outside the sqrt
        x2 = x + residual
        residual.copy_(x2)
        return x2 / (x2.pow(2).mean(-1, keepdim=True).sqrt() + 0.1) * weight, residual

    case = run_case(spec_with(wrong_eps), "planted", SHAPE, torch.float32, device, seed=2)
    assert not case.passed and case.error > 1e-3


def test_verifier_catches_a_kernel_that_forgets_the_residual_write_back(device):
    def no_write_back(x, weight, eps=1e-6, residual=None):
        s = x + residual
        return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight, residual

    case = run_case(spec_with(no_write_back), "planted", SHAPE, torch.float32, device, seed=3)
    assert not case.passed


def test_verifier_catches_unwritten_output_elements(device):
    def skips_last_row(x, weight, eps=1e-6, residual=None):
        residual.add_(x)
        out = empty_like(x)  # poisoned under the verifier
        good = residual[:-1]
        out[:-1] = good * torch.rsqrt(good.pow(2).mean(-1, keepdim=True) + eps) * weight
        return out, residual

    case = run_case(spec_with(skips_last_row), "planted", SHAPE, torch.float32, device, seed=4)
    assert not case.passed and math.isinf(case.error)


def test_verifier_reports_a_crash_as_failure(device):
    def crashes(*args, **kwargs):
        raise RuntimeError("boom")

    case = run_case(spec_with(crashes), "planted", SHAPE, torch.float32, device, seed=5)
    assert not case.passed and "boom" in case.failure


def test_nan_never_passes():
    ref = torch.randn(10)
    out = ref.clone()
    out[3] = float("nan")
    assert math.isinf(relative_error(out, ref))


def test_underflow_below_the_output_dtypes_smallest_subnormal_is_not_an_error():
    ref = torch.tensor([-9.4e-10], dtype=torch.float64)  # gelu_tanh(-5.6) * 0.48: no fp16 holds it
    assert relative_error(ref.to(torch.float16), ref) == 0.0
    assert relative_error(torch.tensor([6e-8], dtype=torch.float16), ref) > 1.0  # the wrong sign fails
    big = torch.tensor([1.0, -9.4e-10], dtype=torch.float64)
    assert relative_error(torch.tensor([1.001, 0.0], dtype=torch.float16), big) > 9e-4  # errors still count
    assert math.isinf(relative_error(torch.tensor([1e-9]), torch.tensor([0.0], dtype=torch.float64)))


def test_verify_rows_cover_every_dtype_of_rms_norm():  # the CPU backend: CPU tensors on any machine
    rows = verify(["rms_norm"], ["cpu"], None, "cpu", seed=random.randrange(2**31))
    assert {r.dtype for r in rows} == {"float32", "float16", "bfloat16"}
    assert all(r.passed and r.cases > 0 for r in rows)


SILU_AND_MUL = get_op("silu_and_mul")
SOFTMAX = get_op("softmax")
WRITE_KV_CACHE = get_op("write_kv_cache")


def planted(spec, fn):
    copy = dataclasses.replace(spec, implementations={})
    copy.register(Implementation("planted", fn))
    return copy


def test_one_wrong_element_cannot_hide_in_the_norm_of_a_large_output():
    """One element of 38889 (a tenth of the largest) zeroed: the norm error stays under bf16's bound,
    the max-error bound (2x it, of the largest magnitude) catches it."""

    def drops_an_element(x):
        d = x.shape[-1] // 2
        out = (torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)
        values = (x[..., :d].float() * torch.sigmoid(x[..., :d].float()) * x[..., d:].float()).abs()
        nearest = (values - 0.1 * values.max()).abs().flatten().argmin()  # one tenth of the largest
        out.view(-1)[nearest] = 0
        return out

    shape = {"rows": 9, "d": 4321}
    case = run_case(planted(SILU_AND_MUL, drops_an_element), "planted", shape, torch.bfloat16, "cpu", seed=6)
    assert case.error < case.tolerance and not case.passed and "max |out - ref|" in case.failure
    assert run_case(SILU_AND_MUL, "cpu", shape, torch.bfloat16, "cpu", seed=6).passed


def test_half_precision_math_fails_the_one_rounding_bound():
    """silu rounded to bf16 before the multiply: within the norm bound, two roundings per element."""

    def silu_then_mul_in_bf16(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d]) * x[..., d:]

    spec = planted(SILU_AND_MUL, silu_then_mul_in_bf16)
    case = run_case(spec, "planted", {"rows": 9, "d": 4321}, torch.bfloat16, "cpu", seed=7)
    assert case.error < case.tolerance and not case.passed and "roundings of bfloat16" in case.failure
    assert run_case(SILU_AND_MUL, "cpu", {"rows": 9, "d": 4321}, torch.bfloat16, "cpu", seed=7).passed


def test_fp8_cache_writes_must_round_to_nearest():
    def rounds_toward_zero(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
        block = key_cache.shape[1]
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        for data, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
            exact = data[valid].float() / scale[None, :, None]
            nearest = exact.to(cache.dtype)
            over = nearest.float().abs() > exact.abs()  # step back one e4m3 value toward zero
            bits = nearest.view(torch.uint8).clone()
            bits[over] -= 1
            cache[slots // block, slots % block] = bits.view(cache.dtype)

    shape = {"num_tokens": 37, "num_kv_heads": 3, "head_dim": 64, "num_blocks": 5, "block_size": 16}
    spec = planted(WRITE_KV_CACHE, rounds_toward_zero)
    case = run_case(spec, "planted", shape, torch.float8_e4m3fn, "cpu", seed=8)
    assert case.error < case.tolerance and not case.passed
    assert run_case(WRITE_KV_CACHE, "cpu", shape, torch.float8_e4m3fn, "cpu", seed=8).passed


def test_an_output_of_another_dtype_than_the_contract_fails():
    def float32_out(x):
        d = x.shape[-1] // 2
        return torch.nn.functional.silu(x[..., :d].float()) * x[..., d:].float()

    spec = planted(SILU_AND_MUL, float32_out)
    case = run_case(spec, "planted", {"rows": 3, "d": 40}, torch.bfloat16, "cpu", seed=9)
    assert not case.passed and "contract says bfloat16" in case.failure


def test_the_reference_dispatched_as_a_backend_keeps_the_contract():
    """KILN_BACKEND=reference (or an op with no path for the device) runs the reference on float64
    copies and rounds once to the op's dtypes: fp8 GEMMs returned float32, gguf_dequantize float64,
    and an fp8 cache write crashed."""
    ops = ["fp8_linear", "int8_linear", "write_kv_cache"]
    if importlib.util.find_spec("gguf") is not None:  # its reference decodes with gguf
        ops.append("gguf_dequantize")
    rows = verify(ops, ["reference"], None, "cpu", seed=10)
    assert rows and all(r.passed for r in rows), [r.failures[:1] for r in rows if not r.passed]


def test_memory_aten_allocates_itself_is_poisoned_too():
    """The native CPU kernels allocate their outputs with at::empty (the dispatcher's aten::empty),
    not kiln.ops.alloc: under poisoned() that memory is NaN as well, and the mode is restored after."""
    from kiln.ops.alloc import poisoned

    before = torch.are_deterministic_algorithms_enabled()
    with poisoned():
        assert bool(torch.ops.aten.empty.memory_format([64]).isnan().all())
        assert bool((torch.empty(8, dtype=torch.int32) == torch.iinfo(torch.int32).max).all())
    assert torch.are_deterministic_algorithms_enabled() == before


def test_an_implementation_that_writes_an_argument_it_should_only_read_fails():
    """A KV cache scribbled over after attention read it, a weight NaN-filled after its GEMM: the
    outputs are right, so only the untouched read-only arguments tell."""
    linear = get_op("linear")
    reference = linear.implementation("reference").fn

    def spoils_the_weight(x, weight, bias=None):
        out = reference(x, weight, bias)
        weight.fill_(float("nan"))
        return out

    shape = {"M": 3, "N": 20, "K": 16, "bias": True}
    case = run_case(planted(linear, spoils_the_weight), "planted", shape, torch.float32, "cpu", seed=2)
    assert not case.passed and "argument weight is read-only" in case.failure
    assert run_case(linear, "cpu", shape, torch.float32, "cpu", seed=2).passed


def test_an_argument_written_in_place_is_compared_whatever_the_op_returns():
    """rms_norm's residual: an implementation that returns a fresh residual and leaves the caller's
    untouched passed (the engine reads the argument itself)."""
    rms_norm = get_op("rms_norm")
    reference = rms_norm.implementation("reference").fn

    def new_residual_not_in_place(x, weight, eps=1e-6, residual=None, weight_offset=0.0):
        fresh = None if residual is None else residual.clone()
        return reference(x, weight, eps, fresh, weight_offset)

    shape = {"rows": 7, "hidden": 96, "residual": True}
    case = run_case(planted(rms_norm, new_residual_not_in_place), "planted", shape, torch.float32, "cpu", 3)
    assert not case.passed
    assert run_case(rms_norm, "cpu", shape, torch.float32, "cpu", seed=3).passed


def test_an_implementation_that_cannot_run_here_is_a_skip_row_not_absent(monkeypatch):
    """By default only the runnable implementations got rows: the summary read "N passed, 0 skipped"
    while a backend never ran."""
    spec = get_op("silu_and_mul")
    monkeypatch.setattr(spec.implementations["cpu"], "is_available", lambda device: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # no Triton kernel on CPU tensors: a SKIP row too
    rows = verify(["silu_and_mul"], None, ["float32"], "cpu", seed=1)
    cpu_rows = [r for r in rows if r.backend == "cpu"]
    assert [(r.dtype, r.skipped) for r in cpu_rows] == [("float32", "not available on cpu")]
    assert any(r.backend != "cpu" and r.passed for r in rows)
    assert any(r.backend == "triton" and r.skipped for r in rows)


def test_a_row_a_fallback_replaced_is_not_a_pass(monkeypatch, capsys, tmp_path):
    """linear/triton replaced by the pointer kernel (TMA given up) checked the replacement: its JSON row
    said passed and the exit status was 0."""
    import json

    from kiln import fallbacks
    from kiln.cli import main

    entry = {"kind": fallbacks.GEMM_TMA_TO_POINTER, "detail": "planted for the test"}
    monkeypatch.setattr(fallbacks, "taken", lambda: [entry])
    out = tmp_path / "v.json"
    argv = ["verify", "--op", "linear", "--backend", "cpu", "--dtype", "float32", "--json", str(out)]
    assert main(argv) == 0  # the cpu rows are not the fallback's
    (cpu_row,) = verify(["linear"], ["cpu"], ["float32"], "cpu", seed=1)
    fake_row = dataclasses.replace(cpu_row, backend="triton")  # a passing row under the replaced name
    monkeypatch.setattr("kiln.verify.runner.verify", lambda *a, **k: [fake_row])
    argv = ["verify", "--op", "linear", "--backend", "cpu", "--dtype", "float32", "--json", str(out)]
    assert main(argv) == 1
    assert "1 fell back (not verified)" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert row["backend"] == "triton->triton_pointer" and row["passed"] is False


def test_a_kernel_that_assumes_contiguous_heads_fails_on_the_engines_fused_qkv_views():
    """q and k are views into the fused QKV row in the engine; the verifier never passed one, and its
    clone() of a view with gaps was contiguous anyway, so a kernel assuming contiguous heads passed."""
    rope = get_op("rotary_embedding")
    right = rope.implementation("cpu").fn

    def assumes_contiguous(positions, q, k, cos_sin_cache, is_neox=True):
        q2, k2 = q.clone(), k.clone()
        right(positions, q2, k2, cos_sin_cache, is_neox)
        for dst, src in ((q, q2), (k, k2)):  # written back as if dst were contiguous
            torch.as_strided(dst, (dst.numel(),), (1,)).copy_(src.reshape(-1))
        return q, k

    shape = {"tokens": 6, "q_heads": 9, "kv_heads": 3, "head_dim": 64, "fused_qkv": True}
    inputs = rope.make_inputs(shape, torch.float32, "cpu", torch.Generator().manual_seed(1))
    assert not inputs["q"].is_contiguous()
    case = run_case(planted(rope, assumes_contiguous), "planted", shape, torch.float32, "cpu", seed=1)
    assert not case.passed
    assert run_case(rope, "cpu", shape, torch.float32, "cpu", seed=1).passed
    for name in ("rotary_embedding", "qk_norm_rope", "write_kv_cache"):  # each fuzzes the engine's views
        assert any(s.get("fused_qkv") for s in get_op(name).fuzz_shapes(random.Random(0))), name


def test_a_cpu_only_backend_is_checked_on_cpu_tensors_whatever_the_device():
    """The GPU machine's test run parametrizes the "cpu" backends with device=cuda: their native kernels
    must get CPU tensors (they crashed in the dispatcher on CUDA ones). "meta" stands in for CUDA here."""
    from kiln.ops.registry import cpu_only

    seen = []

    def cpu_kernel(x, **kwargs):
        seen.append(x.device.type)
        return RMS_NORM.implementation("cpu").fn(x, **kwargs)

    spec = dataclasses.replace(RMS_NORM, implementations={})
    spec.register(Implementation("cpu", cpu_kernel, cpu_only))
    case = run_case(spec, "cpu", SHAPE, torch.float32, torch.device("meta"), seed=3)
    assert seen == ["cpu"] and case.passed, case
