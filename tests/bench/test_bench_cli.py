import argparse
import json
import sys
import types

import kiln.bench.cli as bench_cli
from kiln.bench import results
from kiln.cli import main

SHAPES = '[{"rows": 3, "hidden": 257, "residual": true}, {"rows": 1, "hidden": 64}]'


def test_bench_rms_norm_on_cpu_writes_json_markdown_and_png(tmp_path, capsys):
    rc = main(["bench", "--op", "rms_norm", "--shapes", SHAPES, "--reps", "3", "--out", str(tmp_path)])
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


def test_engine_and_serve_subcommands_delegate_their_arguments(monkeypatch):
    seen = {}
    fake = types.ModuleType("kiln.server.benchmark")
    fake.add_arguments = lambda parser: parser.add_argument("--num-requests", type=int, default=1)

    def run(args: argparse.Namespace) -> int:
        seen["n"] = args.num_requests
        return 0

    fake.run = run
    monkeypatch.setitem(sys.modules, "kiln.server.benchmark", fake)
    assert main(["bench", "serve", "--num-requests", "7"]) == 0
    assert seen == {"n": 7}


def test_missing_delegate_module_prints_a_message_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(bench_cli.DELEGATES, "engine", "kiln.no_such_module.benchmark")
    assert main(["bench", "engine", "--help"]) == 2
    assert "not available in this build" in capsys.readouterr().err


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
