"""CUDA timing paths: only meaningful on a GPU (skipped visibly on CPU machines)."""

import pytest
import torch

from kiln.bench.ceilings import measure_ceilings
from kiln.bench.runner import bench_case
from kiln.bench.suites import Case
from kiln.bench.timing import time_fn
from kiln.ops.norm.rms_norm import RMS_NORM
from kiln.profile.profiler import profile_op

CUDA = torch.device("cuda")


@pytest.mark.gpu
def test_cuda_graph_timing_of_a_copy_is_close_to_bandwidth_ceiling():
    ceilings = measure_ceilings(CUDA)
    src = [torch.randn(8 * 2**20, device=CUDA) for _ in range(4)]  # 4 x 32 MiB
    dst = torch.empty_like(src[0])
    t = time_fn(lambda inputs: dst.copy_(inputs["x"]), [{"x": s} for s in src], CUDA)
    assert t.method == "cuda-graph"
    achieved = 2 * src[0].numel() * 4 / (t.median_ms / 1e3)
    assert 0.3 * ceilings.peak_bandwidth < achieved < 1.3 * ceilings.peak_bandwidth


@pytest.mark.gpu
def test_uncapturable_callable_falls_back_to_event_timing():
    x = torch.randn(1024, device=CUDA)
    t = time_fn(lambda inputs: inputs["x"].sum().item(), [{"x": x}], CUDA, reps=10)  # .item() syncs
    assert t.method == "cuda-events" and t.median_ms > 0


@pytest.mark.gpu
def test_rms_norm_bench_case_on_gpu_is_below_the_roofline():
    ceilings = measure_ceilings(CUDA)
    record = bench_case(
        Case(RMS_NORM, {"rows": 4096, "hidden": 4096, "residual": True}, torch.bfloat16), CUDA, ceilings
    )
    assert record["error"] is None and record["backend"] == "triton" and record["method"] == "cuda-graph"
    assert record["copies"] >= 2  # 64 MiB of inputs per copy: two or more exceed twice a 50 MB L2
    assert 0.05 < record["roofline_fraction"] <= 1.2
    assert record["baselines"]["torch_eager"]["speedup"] > 0


@pytest.mark.gpu
def test_profile_maps_the_triton_kernel_to_its_op():
    report = profile_op(
        "rms_norm", {"rows": 64, "hidden": 4096, "residual": True}, torch.bfloat16, CUDA, steps=3
    )
    kernel = next(k for k in report.kernels if "rms_norm" in k.name)
    assert kernel.op == "rms_norm" and kernel.calls == 3
    assert 0 < report.ops["rms_norm"]["fraction"] <= 1.2
