import math

import pytest
import torch

from kiln.bench.ceilings import Ceilings
from kiln.bench.roofline import ridge_point, roofline


def test_memory_bound_case_hand_computed():
    # 1 GFLOP moving 4 GB on a 1 TB/s, 100 TFLOP/s device: memory needs 4 ms, compute 10 us.
    point = roofline(flops=1e9, bytes_moved=4e9, seconds=8e-3, peak_flops=100e12, peak_bandwidth=1e12)
    assert point.bound_s == pytest.approx(4e-3)
    assert point.fraction == pytest.approx(0.5)
    assert point.limiter == "memory"
    assert point.intensity == pytest.approx(0.25)
    assert point.bytes_per_s == pytest.approx(5e11)
    assert point.flops_per_s == pytest.approx(1.25e11)


def test_compute_bound_case_hand_computed():
    # 2*4096^3 FLOP GEMM moving 3*4096^2*2 bytes: compute 1.374 ms at 100 TFLOP/s, memory 0.1 ms at 1 TB/s.
    flops, nbytes = 2 * 4096**3, 3 * 4096**2 * 2
    point = roofline(flops, nbytes, seconds=2e-3, peak_flops=100e12, peak_bandwidth=1e12)
    assert point.limiter == "compute"
    assert point.bound_s == pytest.approx(flops / 100e12)
    assert point.fraction == pytest.approx(flops / 100e12 / 2e-3)
    assert point.intensity == pytest.approx(4096 / 3)


def test_ridge_point_is_where_both_ceilings_meet():
    ridge = ridge_point(100e12, 1e12)
    assert ridge == pytest.approx(100.0)
    at_ridge = roofline(ridge * 1e9, 1e9, 1.0, 100e12, 1e12)
    assert at_ridge.bound_s == pytest.approx(1e-3)


def test_zero_bytes_gives_infinite_intensity_not_a_crash():
    assert math.isinf(roofline(1e6, 0, 1e-3, 1e12, 1e12).intensity)


def test_nonpositive_time_or_ceiling_is_rejected():
    with pytest.raises(ValueError, match="must be positive"):
        roofline(1.0, 1.0, 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="must be positive"):
        roofline(1.0, 1.0, 1.0, 0.0, 1.0)


def test_peak_flops_uses_the_dtype_measured_else_bf16_for_halves_else_the_best():
    ceilings = Ceilings("dev", 1000.0, {"bfloat16": 800.0, "float32": 60.0})
    assert ceilings.peak_flops("float32") == pytest.approx(60e12)
    assert ceilings.peak_flops("float16") == pytest.approx(800e12)
    assert ceilings.peak_flops("int8") == pytest.approx(800e12)
    assert ceilings.peak_bandwidth == pytest.approx(1e12)
    with_tf32 = Ceilings(
        "dev", 1000.0, {"bfloat16": 800.0, "float32": 60.0, "tfloat32": 400.0, "float8_e4m3fn": 1600.0}
    )
    assert with_tf32.peak_flops(torch.float32) == pytest.approx(400e12)  # Triton's fp32 dot uses TF32
    assert with_tf32.peak_flops(torch.float8_e4m3fn) == pytest.approx(1600e12)
    assert with_tf32.peak_flops(torch.bfloat16) == pytest.approx(800e12)


def test_int8_takes_its_measured_peak_else_fp8s():
    fp8 = Ceilings("dev", 1000.0, {"bfloat16": 800.0, "float8_e4m3fn": 1600.0})
    assert fp8.peak_flops(torch.int8) == pytest.approx(1600e12)
    both = Ceilings("dev", 1000.0, {"bfloat16": 800.0, "float8_e4m3fn": 1600.0, "int8": 1700.0})
    assert both.peak_flops(torch.int8) == pytest.approx(1700e12)


@pytest.mark.parametrize("op, operands", [("fp8_linear", torch.float8_e4m3fn), ("int8_linear", torch.int8)])
def test_a_quantized_gemms_roofline_uses_its_operands_peak_not_its_output_dtypes(op, operands):
    """fp8 / int8 GEMMs with bf16 output were held to the bf16 peak: % of roofline 2x too high."""
    from kiln.bench.runner import bench_case
    from kiln.bench.suites import Case
    from kiln.ops import get_op

    spec = get_op(op)
    ceilings = Ceilings("dev", 1e-3, {"bfloat16": 1e-6, "float8_e4m3fn": 4e-6})  # compute-bound here
    shape = {"M": 3, "N": 40, "K": 64, "bias": False, "per_token": True}
    record = bench_case(Case(spec, shape, torch.bfloat16), torch.device("cpu"), ceilings, "reference", False)
    assert record["error"] is None
    peak = ceilings.peak_flops(operands)
    assert record["roofline_bound_ms"] == pytest.approx(
        max(spec.flops(shape, torch.bfloat16) / peak, spec.bytes(shape, torch.bfloat16) / 1e6) * 1e3
    )


def test_over_100_percent_names_its_cause_by_limiter():
    """A compute-bound case over its roofline is a ceiling measured too low (int8 on an H200: 745 %),
    not cached inputs."""
    from kiln.bench.report import _percent_of_roofline

    assert _percent_of_roofline(0.5, "compute") == "50.0%"
    assert _percent_of_roofline(1.2, "memory").endswith("(cached)")
    assert _percent_of_roofline(7.45, "compute").endswith("(ceiling too low)")


def test_the_int8_ceiling_times_a_column_major_b(monkeypatch):
    """cuBLASLt's int8 GEMM is fast with b column-major; a row-major b measured ~126 TOPS on an H200."""
    import torch

    from kiln.bench import ceilings

    seen = []

    def int_mm(a, b):
        seen.append(b.stride())
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    monkeypatch.setattr(ceilings, "_best_seconds", lambda fn, device, reps: (fn(), 1.0)[1])
    assert ceilings._int8_tops(torch.device("cpu"), 32) is not None
    assert seen and seen[0] == (1, 32)
