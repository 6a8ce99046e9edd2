"""`kiln verify --json`: the file carries the environment, is rewritten after every row (a run stopped
by a time limit keeps what finished), and marks rows whose kernel a recorded fallback replaced."""

import json

import pytest

import kiln.verify.runner as runner
from kiln import fallbacks
from kiln.cli import main
from kiln.verify.report import row_json
from kiln.verify.runner import Row


@pytest.fixture(autouse=True)
def no_fallbacks():
    fallbacks.clear()
    yield
    fallbacks.clear()


def verify_rms_norm_cpu(path):
    return main(["verify", "--op", "rms_norm", "--backend", "cpu", "--device", "cpu", "--json", str(path)])


def test_json_has_rows_environment_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_COMMIT", "0123abc")
    path = tmp_path / "verify.json"
    assert verify_rms_norm_cpu(path) == 0
    payload = json.loads(path.read_text())
    assert payload["complete"] is True and payload["kind"] == "kiln-verify"
    assert {r["dtype"] for r in payload["rows"]} == {"float32", "float16", "bfloat16"}
    env = payload["environment"]
    assert env["git_commit"] == "0123abc" and env["commit_source"] == "KILN_COMMIT"
    assert env["torch"] and env["fallbacks"] == [] and "cpu_flags" in env
    assert all(r["fallback"] is None for r in payload["rows"])


def test_interrupted_run_keeps_the_rows_that_finished(tmp_path, monkeypatch, capsys):
    real_verify = runner.verify

    def verify_then_sigint(*args, progress=None, **kwargs):
        def interrupt_after_first(row):
            progress(row)
            raise KeyboardInterrupt  # what `timeout -s INT` delivers

        return real_verify(*args, progress=interrupt_after_first, **kwargs)

    monkeypatch.setattr(runner, "verify", verify_then_sigint)
    path = tmp_path / "verify.json"
    rc = verify_rms_norm_cpu(path)
    assert rc == 130 and "interrupted after 1 rows" in capsys.readouterr().err
    payload = json.loads(path.read_text())
    assert payload["complete"] is False and len(payload["rows"]) == 1 and payload["rows"][0]["passed"]


def test_row_replaced_by_a_recorded_fallback_is_marked():
    fallbacks.record(fallbacks.GEMM_TMA_TO_POINTER, "CompilationError('no TMA')")
    entries = fallbacks.taken()
    marked = row_json(Row("linear", "triton", "bfloat16", cases=3), entries)
    assert marked["backend"] == "triton->triton_pointer" and "no TMA" in marked["fallback"]
    for row in (Row("linear", "cpu", "float32", cases=3), Row("rms_norm", "triton", "float32", cases=3)):
        assert row_json(row, entries)["fallback"] is None and row_json(row, entries)["backend"] == row.backend


@pytest.mark.parametrize(
    "args, named",
    [
        (["--op", "no_such_op"], "unknown op(s) no_such_op"),
        (["--op", "softmax", "--backend", "no_such_backend"], "unknown backend(s) no_such_backend"),
        (["--op", "softmax", "--dtype", "float99"], "unknown dtype(s) float99"),
    ],
)
def test_an_unknown_op_backend_or_dtype_exits_2_naming_it(args, named, capsys):
    """They ran nothing and exited 1 with no reason given (backend, dtype) or a traceback (op)."""
    assert main(["verify", "--device", "cpu", *args]) == 2
    assert named in capsys.readouterr().err


def test_shards_cover_every_op_of_the_backend_once(capsys, monkeypatch):
    """`--shard I/N` splits the ops that have the asked backend over N processes: none twice, none left
    out (a GPU run verifies a backend in several processes at once). The cases themselves are stubbed."""
    from kiln.ops import all_ops
    from kiln.verify import runner

    def no_case(spec, backend, shape, dtype, device, seed):
        return runner.CaseResult(spec.name, backend, runner.dtype_name(dtype), shape, 0.0, 1.0, seed)

    monkeypatch.setattr(runner, "run_case", no_case)
    having = sorted(name for name, spec in all_ops().items() if "triton" in spec.backends())
    shards = [
        {r.op for r in runner.verify(backends=["triton"], device="cpu", shard=(i, 4))} for i in (1, 2, 3, 4)
    ]
    assert sorted(op for shard in shards for op in shard) == having and all(shards)
    assert main(["verify", "--device", "cpu", "--shard", "5/4"]) == 2
    assert "--shard '5/4'" in capsys.readouterr().err
