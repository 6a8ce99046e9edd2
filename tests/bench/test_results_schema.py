import copy

import pytest
import torch

from kiln.bench import results
from kiln.bench.ceilings import Ceilings
from kiln.bench.runner import bench
from kiln.bench.suites import Case
from kiln.ops.norm.rms_norm import RMS_NORM

CEILINGS = Ceilings("CPU test", bandwidth_gbs=10.0, matmul_tflops={"float32": 0.1})


@pytest.fixture(scope="module")
def cpu_payload():
    cases = [
        Case(RMS_NORM, {"rows": 5, "hidden": 333, "residual": True}, torch.float32),
        Case(RMS_NORM, {"rows": 2, "hidden": 65}, torch.float16),
    ]
    records = bench(cases, torch.device("cpu"), CEILINGS, timing_kwargs={"reps": 3, "warmup": 1})
    metadata = results.collect_metadata(torch.device("cpu"), CEILINGS.device_name, "test")
    return results.make_payload(
        metadata,
        {
            "device_name": "CPU test",
            "bandwidth_gbs": 10.0,
            "matmul_tflops": {"float32": 0.1},
            "method": "",
            "measured_at": "",
        },
        records,
    )


def test_cpu_payload_has_versioned_metadata_and_typed_cases(cpu_payload):
    assert cpu_payload["kind"] == "kiln-bench" and cpu_payload["schema_version"] == 1
    meta = cpu_payload["metadata"]
    assert meta["timing"] == "CPU timings" and meta["device_type"] == "cpu"
    assert meta["torch"] == torch.__version__ and meta["triton"]
    assert len(cpu_payload["cases"]) == 2
    for case in cpu_payload["cases"]:
        assert case["error"] is None, case["error"]
        assert case["backend"] == "cpu" and case["method"] == "cpu-wallclock"
        for name, types in results.CASE_FIELDS.items():
            assert isinstance(case[name], types), name
        assert 0 < case["p20_ms"] <= case["median_ms"] <= case["p80_ms"]
        # derived fields agree with the measured time and the spec's models
        seconds = case["median_ms"] / 1e3
        assert case["gbps"] == pytest.approx(case["bytes"] / seconds / 1e9)
        bound = max(case["flops"] / 0.1e12, case["bytes"] / 10e9)
        assert case["roofline_fraction"] == pytest.approx(bound / seconds)
        base = case["baselines"]["torch_eager"]
        assert base["speedup"] == pytest.approx(base["median_ms"] / case["median_ms"])
        # how each side was timed, and how many bytes the timed calls rotate through
        assert base["method"] == case["method"] == "cpu-wallclock"
        assert case["rotated_bytes"] == pytest.approx(case["copies"] * case["bytes"])


def test_file_name_is_date_and_device_slug(cpu_payload, tmp_path):
    path = results.write(cpu_payload, tmp_path, suffix="Nightly Run")
    assert path.name == f"{cpu_payload['metadata']['date'][:10]}-cpu-test-nightly-run.json"
    assert results.load(path) == cpu_payload


def test_a_second_run_the_same_day_gets_its_own_file(cpu_payload, tmp_path):
    """It overwrote the first (bench/results/ is the default --out)."""
    first = results.write(cpu_payload, tmp_path)
    second = results.write(cpu_payload, tmp_path)
    third = results.write(cpu_payload, tmp_path)
    assert len({first, second, third}) == 3 and all(p.exists() for p in (first, second, third))
    assert second.name == first.name.replace(".json", "-2.json")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.pop("ceilings"), "missing 'ceilings'"),
        (lambda p: p["metadata"].pop("git_commit"), "metadata lacks git_commit"),
        (lambda p: p["cases"][0].pop("median_ms"), "lacks 'median_ms'"),
        (lambda p: p["cases"][0].update(median_ms="fast"), "field 'median_ms' has type str"),
        (lambda p: p.update(schema_version=99), "schema_version 99"),
    ],
)
def test_validation_names_what_is_wrong(cpu_payload, mutate, message):
    broken = copy.deepcopy(cpu_payload)
    mutate(broken)
    with pytest.raises(ValueError, match=message):
        results.validate(broken)


def test_a_case_that_cannot_run_is_recorded_with_its_error():
    records = bench(
        [Case(RMS_NORM, {"rows": 2, "hidden": 8}, torch.float32)],
        torch.device("cpu"),
        CEILINGS,
        backend="no_such_backend",
    )
    assert records[0]["median_ms"] is None and "no implementation 'no_such_backend'" in records[0]["error"]
