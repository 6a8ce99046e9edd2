"""What a result records about where it ran: the commit (KILN_COMMIT, git, or .kiln-commit on a copy
without .git), GPU, CPU and ISA, versions, and every fallback taken, with the affected rows marked."""

import os
import platform
import sys
import threading

import pytest
import torch

from kiln import environment, fallbacks
from kiln.bench import report, results


@pytest.fixture(autouse=True)
def no_fallbacks():
    fallbacks.clear()
    yield
    fallbacks.clear()


def case(op, backend, error=None):
    """A result record as kiln.bench.runner makes it: timed, or with the error that stopped it."""
    fields = {name: None for name in results.CASE_FIELDS}
    timed = {"median_ms": 1.0, "p20_ms": 0.9, "p80_ms": 1.1, "tflops": 1.0, "gbps": 1.0,
             "roofline_fraction": 0.5, "limiter": "memory"}  # fmt: skip
    return {**fields, **({} if error else timed), "op": op, "shape": {"M": 1}, "dtype": "bfloat16",
            "backend": backend, "flops": 1.0, "bytes": 1.0, "baselines": {}, "error": error}  # fmt: skip


CEILINGS = {"device_name": "t", "bandwidth_gbs": 1.0, "matmul_tflops": {}, "method": "", "measured_at": ""}


def test_commit_from_the_variable_then_git_then_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_COMMIT", "abc123-dirty")
    assert environment.commit() == {"git_commit": "abc123", "git_dirty": True, "commit_source": "KILN_COMMIT"}
    monkeypatch.delenv("KILN_COMMIT")
    monkeypatch.setattr(environment, "REPO_ROOT", tmp_path)  # a copy without .git
    monkeypatch.chdir(tmp_path)
    assert environment.commit()["git_commit"] is None
    (tmp_path / ".kiln-commit").write_text("def456\n")
    from_file = {"git_commit": "def456", "git_dirty": False, "commit_source": ".kiln-commit"}
    assert environment.commit() == from_file


def test_environment_names_versions_cpu_and_gpu():
    env = environment.environment()
    assert env["torch"] == torch.__version__ and env["python"]
    assert set(env["cpu_flags"]) <= set(environment.ISA_FLAGS)
    if os.path.exists("/proc/cpuinfo") and platform.machine() in (
        "x86_64",
        "AMD64",
    ):  # "family 25 model 17 ..."
        assert env["cpu_model"] and env["cpu_id"].startswith("family ")
    assert (env["gpu_name"] is None) == (not torch.cuda.is_available())
    assert env["fallbacks"] == []
    assert env["cpu_count"] == os.cpu_count() and env["torch_threads"] == torch.get_num_threads()
    assert env["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS")


def test_fallbacks_are_recorded_once_per_reason_from_any_thread():
    def work():
        for _ in range(50):
            fallbacks.record(fallbacks.GEMM_TMA_TO_POINTER, "same reason")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fallbacks.record(fallbacks.CUDA_GRAPH_TO_EAGER, "capture failed")
    taken = fallbacks.taken()
    assert [(e["kind"], e["count"]) for e in taken] == [("gemm_tma->pointer", 400), ("cuda_graph->eager", 1)]
    taken[0]["count"] = 0  # a copy: the record itself is unchanged
    assert fallbacks.taken()[0]["count"] == 400


def test_case_whose_kernel_fell_back_is_not_reported_under_its_name():
    fallbacks.record(fallbacks.GEMM_TMA_TO_POINTER, "CompilationError('no TMA')")
    metadata = results.collect_metadata(torch.device("cpu"), "t", "llm")
    cases = [case("linear", "triton"), case("linear", "cpu"), case("rms_norm", "triton"),
             case("linear_silu_mul", "triton", error="OutOfMemoryError")]  # fmt: skip
    payload = results.make_payload(metadata, CEILINGS, cases)
    marked, cpu, norm, failed = payload["cases"]
    assert marked["backend"] == "triton->triton_pointer" and "no TMA" in marked["fallback"]
    assert cpu["fallback"] is norm["fallback"] is failed["fallback"] is None
    assert (cpu["backend"], norm["backend"], failed["backend"]) == ("cpu", "triton", "triton")
    (entry,) = payload["metadata"]["environment"]["fallbacks"]
    assert entry["kind"] == fallbacks.GEMM_TMA_TO_POINTER
    text = report.format_markdown(payload)
    assert "FALLBACK taken: gemm_tma->pointer" in text and "triton->triton_pointer (FALLBACK)" in text


def test_results_without_the_new_fields_still_load(tmp_path):
    payload = results.make_payload(results.collect_metadata(torch.device("cpu"), "t", "llm"), CEILINGS,
                                   [case("rms_norm", "cpu")])  # fmt: skip
    del payload["metadata"]["environment"], payload["cases"][0]["fallback"]
    results.validate(payload)
    payload["cases"][0]["fallback"] = 3
    with pytest.raises(ValueError, match="'fallback'"):
        results.validate(payload)


def test_gemm_that_falls_back_from_tma_is_benchmarked_as_the_pointer_kernel(device, monkeypatch):
    """The dense GEMM's TMA kernel fails to build (as on a Triton without TMA support): the launcher must
    record the fallback once, use the pointer path from then on, and the bench row must say so
    instead of reporting it as "triton". The pointer kernel itself is stood in for by a recorder (it
    has its own tests; the GPU image's Triton 3.6 cannot interpret it on a CPU)."""
    from kiln.bench.ceilings import Ceilings
    from kiln.bench.runner import bench
    from kiln.bench.suites import Case
    from kiln.ops import get_op

    linear = get_op("linear")
    dense = sys.modules[linear.implementation("triton").fn.__module__]  # wherever the launcher lives
    pointer_launches = []

    def tma_fails(*args, **kwargs):
        raise RuntimeError("TMA descriptors are not supported by this Triton")

    def pointer(x2, weight, bias, out, partials, cfg, silu_mul):
        pointer_launches.append(x2.shape)
        torch.matmul(x2, weight.t(), out=out)

    monkeypatch.setattr(dense, "use_tma", lambda *args: True)
    monkeypatch.setattr(dense, "launch_linear_tma", tma_fails)
    monkeypatch.setattr(dense, "_launch_pointer", pointer)
    monkeypatch.setattr(dense, "_TMA_FAILED", [])
    ceilings = Ceilings("test", bandwidth_gbs=10.0, matmul_tflops={"float32": 0.1})
    shape = {"M": 8, "N": 16, "K": 32}
    records = bench([Case(linear, shape, torch.float32)], device, ceilings, "triton", False, {"reps": 2})
    assert records[0]["error"] is None, records[0]["error"]
    assert pointer_launches, "the pointer path never ran"
    (entry,) = fallbacks.taken()
    assert entry["kind"] == fallbacks.GEMM_TMA_TO_POINTER and entry["count"] == 1  # given up once, for good
    metadata = results.collect_metadata(device, "test", "test")
    (row,) = results.make_payload(metadata, CEILINGS, records)["cases"]
    assert row["backend"] == "triton->triton_pointer"
    assert "not supported by this Triton" in row["fallback"]
