"""The verifier must be able to fail: wrong kernels, NaNs and unwritten outputs are caught."""

import dataclasses
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
