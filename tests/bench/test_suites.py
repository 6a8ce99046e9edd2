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


def test_ops_with_slow_inputs_get_their_bench_copies_by_cloning(monkeypatch):
    """GGUF weights are quantized on the host (seconds for a Llama-3-8B weight), and on an H200 a
    decode case rotates ~6 L2-flushing copies: the quant suite's GGUF step ran out of time making
    inputs. Specs with copy_inputs now make one set and clone it; each copy's tensors are new memory
    with the same values, and prepared_linear's baseline tables follow the clones."""
    from kiln.bench.runner import make_input_sets
    from kiln.ops import get_op
    from kiln.ops.gemm.prepared_linear.spec import _BASELINE_MATRICES, gguf_source

    spec = get_op("prepared_linear")
    made = []
    real = spec.make_inputs
    monkeypatch.setattr(spec, "make_inputs", lambda *a: made.append(a) or real(*a))
    shape = {"M": 1, "N": 32, "K": 64, "format": "gguf", "source": "Q4_1"}  # the blocks as they are
    sets = make_input_sets(spec, shape, torch.float32, torch.device("cpu"), max_copies=3)
    assert len(made) == 1 and len(sets) == 3
    first, copy = sets[0], sets[2]
    assert copy["weight"][0].data_ptr() != first["weight"][0].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(first["weight"], copy["weight"], strict=True))
    assert torch.equal(copy["x"], first["x"]) and copy["x"].data_ptr() != first["x"].data_ptr()
    assert torch.equal(_BASELINE_MATRICES[id(copy["weight"][0])], _BASELINE_MATRICES[id(first["weight"][0])])
    assert gguf_source(copy["weight"])[1] == "Q4_1"
