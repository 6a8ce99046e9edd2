import json

import pytest

from kiln.bench import results
from kiln.bench.compare import compare_cases, exit_code, format_comparison
from kiln.cli import main


def case(op="rms_norm", rows=64, median=1.0, spread=0.02, error=None, backend="triton"):
    """A result case with median `median` ms and p20..p80 = median * (1 -/+ spread/2)."""
    timed = error is None
    return {
        "op": op,
        "shape": {"rows": rows, "hidden": 4096},
        "dtype": "bfloat16",
        "backend": backend,
        "method": "cuda-graph" if timed else None,
        "median_ms": median if timed else None,
        "p20_ms": median * (1 - spread / 2) if timed else None,
        "p80_ms": median * (1 + spread / 2) if timed else None,
        "rel_spread": spread if timed else None,
        "reps": 100 if timed else None,
        "copies": 4 if timed else None,
        "flops": 1e6,
        "bytes": 1e7,
        "tflops": 1e6 / median / 1e9 if timed else None,
        "gbps": 1e7 / median / 1e6 if timed else None,
        "intensity": 0.1 if timed else None,
        "roofline_bound_ms": 0.5 if timed else None,
        "roofline_fraction": 0.5 / median if timed else None,
        "limiter": "memory" if timed else None,
        "baselines": {},
        "error": error,
    }


def payload(cases):
    metadata = {key: None for key in results.METADATA_FIELDS}
    metadata.update(date="2026-01-01T00:00:00Z", device_name="Test GPU", timing="CUDA timings")
    ceilings = {
        "device_name": "Test GPU",
        "bandwidth_gbs": 1000.0,
        "matmul_tflops": {"bfloat16": 500.0},
        "method": "synthetic",
        "measured_at": "",
    }
    return results.make_payload(metadata, ceilings, cases)


def test_real_regression_is_flagged_and_fails():
    rows = compare_cases(payload([case(median=1.0)]), payload([case(median=1.3)]))
    assert [r.status for r in rows] == ["regressed"]
    assert rows[0].change == pytest.approx(0.3)
    assert exit_code(rows) == 1


def test_difference_within_the_runs_spread_is_noisy_not_a_regression_unless_strict():
    # 12% slower, but each run's own p20-p80 spread is 15%: not a regression, but not "same" either
    rows = compare_cases(payload([case(median=1.0, spread=0.15)]), payload([case(median=1.12, spread=0.15)]))
    assert [r.status for r in rows] == ["noisy"]
    assert rows[0].allowed > 0.12
    assert exit_code(rows) == 0 and exit_code(rows, strict=True) == 1
    assert "1 noisy" in format_comparison(rows)
    # inside the threshold, noise or not: same
    rows = compare_cases(payload([case(median=1.0, spread=0.15)]), payload([case(median=1.03, spread=0.15)]))
    assert [r.status for r in rows] == ["same"] and exit_code(rows, strict=True) == 0


def test_small_change_below_threshold_is_noise_even_with_tight_spread():
    rows = compare_cases(payload([case(median=1.0, spread=0.0)]), payload([case(median=1.04, spread=0.0)]))
    assert [r.status for r in rows] == ["same"] and exit_code(rows) == 0


def test_improvement_is_reported_and_passes():
    rows = compare_cases(payload([case(median=2.0)]), payload([case(median=1.0)]))
    assert [r.status for r in rows] == ["improved"] and exit_code(rows) == 0


def test_a_case_missing_from_new_fails_unless_allowed_and_a_new_case_is_listed():
    old = [case(rows=1), case(rows=64)]
    new = [case(rows=64), case(rows=4096)]
    rows = compare_cases(payload(old), payload(new))
    by_rows = {json.loads(r.key[1])["rows"]: r.status for r in rows}
    assert by_rows == {64: "same", 4096: "missing-in-old", 1: "missing-in-new"}
    assert exit_code(rows) == 1 and exit_code(rows, allow_missing=True) == 0
    only_new = compare_cases(payload([case(rows=64)]), payload(new))
    assert exit_code(only_new) == 0


def test_a_case_that_falls_back_is_matched_to_its_own_and_fails():
    """A fallback renames the backend (triton->triton_pointer): the 3x slower case was listed as two
    missing cases and passed."""
    fell = dict(case(median=3.0), backend="triton->triton_pointer", fallback="tma -> pointer")
    rows = compare_cases(payload([case(median=1.0)]), payload([fell]))
    assert [r.status for r in rows] == ["fell-back"] and exit_code(rows) == 1


def test_runs_from_different_hosts_are_refused_unless_forced(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(payload([case()])))
    other = payload([case()])
    other["metadata"]["device_name"] = "Other GPU"
    b.write_text(json.dumps(other))
    assert main(["bench", "compare", str(a), str(b)]) == 2
    assert "different hosts" in capsys.readouterr().err
    assert main(["bench", "compare", str(a), str(b), "--force"]) == 0


def test_case_that_ran_before_and_errors_now_is_broken():
    rows = compare_cases(payload([case()]), payload([case(error="RuntimeError: boom")]))
    assert [r.status for r in rows] == ["broken"] and exit_code(rows) == 1


def test_backends_are_distinct_cases():
    rows = compare_cases(payload([case(backend="triton")]), payload([case(backend="cpu", median=5.0)]))
    assert sorted(r.status for r in rows) == ["missing-in-new", "missing-in-old"]


def test_compare_command_exit_codes_and_table(tmp_path, capsys):
    old, slow, noisy = tmp_path / "old.json", tmp_path / "slow.json", tmp_path / "noisy.json"
    old.write_text(json.dumps(payload([case(median=1.0, spread=0.1), case(rows=1)])))
    slow.write_text(json.dumps(payload([case(median=1.5, spread=0.1), case(rows=1)])))
    noisy.write_text(json.dumps(payload([case(median=1.08, spread=0.1), case(rows=1, median=0.97)])))
    assert main(["bench", "compare", str(old), str(slow)]) == 1
    assert "REGRESSED" in capsys.readouterr().out
    assert main(["bench", "compare", str(old), str(noisy)]) == 0
    assert (
        main(["bench", "compare", str(old), str(noisy), "--threshold", "0.01"]) == 0
    )  # spread still covers it
    assert main(["bench", "compare", str(old), str(tmp_path / "absent.json")]) == 2
