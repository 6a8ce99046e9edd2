import json

import pytest

from kiln.bench import engine as bench_engine
from kiln.bench import results
from kiln.bench import serve as bench_serve
from kiln.bench import tp as bench_tp
from kiln.cli import main

SHAPES = '[{"rows": 3, "hidden": 257, "residual": true}, {"rows": 1, "hidden": 64}]'


def test_bench_rms_norm_on_cpu_writes_json_markdown_and_png(tmp_path, capsys):
    argv = ["bench", "--op", "rms_norm", "--shapes", SHAPES, "--reps", "3", "--out", str(tmp_path)]
    rc = main([*argv, "--device", "cpu"])  # CPU timings asserted below, also on a machine with a GPU
    assert rc == 0
    (json_path,) = tmp_path.glob("*.json")
    payload = results.load(json_path)
    assert [c["shape"]["hidden"] for c in payload["cases"]] == [257, 64]
    assert all(c["error"] is None and c["backend"] == "cpu" for c in payload["cases"])
    assert payload["metadata"]["timing"] == "CPU timings"
    assert payload["ceilings"]["bandwidth_gbs"] > 0 and payload["ceilings"]["matmul_tflops"]["float32"] > 0
    markdown = json_path.with_suffix(".md").read_text()
    assert "CPU timings" in markdown and "| rms_norm | rows=3, hidden=257, residual=True |" in markdown
    assert "vs torch_eager" in markdown
    assert json_path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "rms_norm" in capsys.readouterr().out


def test_bench_with_no_runnable_case_exits_2(tmp_path):
    assert main(["bench", "--op", "rms_norm", "--dtype", "float64", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


def test_engine_serve_and_tp_subcommands_parse_their_own_options(monkeypatch):
    seen = {}

    def recorder(name):
        def run(args):
            seen[name] = args
            return 0

        return run

    for name, module in (("engine", bench_engine), ("serve", bench_serve), ("tp", bench_tp)):
        monkeypatch.setattr(module, "run", recorder(name))
    assert main(["bench", "serve", "--requests", "7", "--concurrency", "2", "4"]) == 0
    assert main(["bench", "engine", "--max-tokens", "5", "--hf-batches", "", "--decode-loop"]) == 0
    assert main(["bench", "tp", "--tp", "4"]) == 0
    assert seen["serve"].requests == 7 and seen["serve"].concurrency == [2, 4]
    assert seen["engine"].max_tokens == 5 and seen["engine"].hf_batches == "" and seen["engine"].decode_loop
    assert seen["tp"].tp == 4 and seen["tp"].max_tokens == 64
    # each run sees only its own options (they are the result JSON's "config"), not `kiln bench`'s
    assert "suite" not in vars(seen["engine"]) and "func" not in vars(seen["serve"])
    assert set(vars(seen["tp"])) == {"tp", "model", "max_tokens", "device"}


def test_benchmark_subcommands_reject_options_they_do_not_have(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--num-requests", "7"])
    assert exit_info.value.code == 2 and "--num-requests" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--help"])
    assert exit_info.value.code == 0 and "--hf-batches" in capsys.readouterr().out


def test_bench_json_is_plain_json(tmp_path):
    main(
        [
            "bench",
            "--op",
            "rms_norm",
            "--shapes",
            '{"rows": 2, "hidden": 16}',
            "--reps",
            "3",
            "--no-baselines",
            "--no-plot",
            "--out",
            str(tmp_path),
            "--suffix",
            "smoke",
        ]
    )
    (path,) = tmp_path.glob("*-smoke.json")
    assert json.loads(path.read_text())["cases"][0]["baselines"] == {}
    assert not list(tmp_path.glob("*.png"))
