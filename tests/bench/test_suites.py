import json

import pytest
import torch

from kiln.bench.suites import dtype_from_name, parse_shapes, resolve_cases
from kiln.ops.norm.rms_norm import RMS_NORM


def test_shapes_from_inline_json_a_file_and_a_suite_name(tmp_path):
    assert parse_shapes('{"rows": 3, "hidden": 7}', RMS_NORM, "llm") == [{"rows": 3, "hidden": 7}]
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([{"rows": 1, "hidden": 2}, {"rows": 5, "hidden": 9}]))
    assert parse_shapes(str(path), RMS_NORM, "llm") == [{"rows": 1, "hidden": 2}, {"rows": 5, "hidden": 9}]
    assert parse_shapes("llm", RMS_NORM, "other") == RMS_NORM.bench_shapes["llm"]
    assert parse_shapes(None, RMS_NORM, "llm") == RMS_NORM.bench_shapes["llm"]


def test_unknown_suite_and_bad_json_shapes_are_value_errors():
    with pytest.raises(ValueError, match="no shape suite 'tiny'"):
        parse_shapes("tiny", RMS_NORM, "llm")
    with pytest.raises(ValueError, match="JSON object or a list"):
        parse_shapes("[1, 2]", RMS_NORM, "llm")
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_name("float13")


def test_cases_cover_requested_dtypes_and_reject_unknown_ops():
    cpu = torch.device("cpu")
    cases = resolve_cases(["rms_norm"], "llm", '{"rows": 2, "hidden": 8}', ["float16", "bf16"], cpu)
    assert [c.dtype for c in cases] == [torch.float16, torch.bfloat16]
    assert resolve_cases(["rms_norm"], "llm", None, None, cpu)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="unknown op"):
        resolve_cases(["no_such_op"], "llm", None, None, cpu)


def test_a_baseline_that_does_not_apply_to_a_case_is_left_out_not_an_error():
    """prepared_linear's GGUF comparisons (gguf_linear on the file's blocks, bf16 cuBLAS) belong to its
    CUDA layouts: on a CPU layout they raise BaselineNotApplicable and the record leaves them out
    (before, every CPU case would have carried two "error" columns)."""
    from kiln.bench.ceilings import measure_ceilings
    from kiln.bench.runner import bench_case
    from kiln.bench.suites import Case
    from kiln.ops import get_op

    cpu = torch.device("cpu")
    shape = {"M": 1, "N": 32, "K": 64, "format": "fp32", "source": "Q4_1"}
    record = bench_case(Case(get_op("prepared_linear"), shape, torch.float32), cpu, measure_ceilings(cpu),
                        backend="cpu", timing_kwargs={"reps": 2})  # fmt: skip
    assert record["error"] is None
    assert set(record["baselines"]) == {"torch_linear_fp32"}
    assert record["baselines"]["torch_linear_fp32"]["median_ms"] > 0
