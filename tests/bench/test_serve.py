"""`kiln bench serve`: every level's requests complete and are counted, latencies are reported,
the JSON and the Markdown table are written, non-loopback URLs are refused, and the command can
start its own server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")  # the server's packages (absent on the GPU machine)
pytest.importorskip("uvicorn")
from server.fake_engine import FakeEngine  # noqa: E402  (tests/server/fake_engine.py)

from kiln.bench import serve  # noqa: E402
from kiln.cli import main as kiln_main  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.launch import ServerThread  # noqa: E402


@pytest.fixture(scope="module")
def loaded_smollm2():
    from kiln.loaders import load_model

    return load_model(device="cpu")


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert serve.percentile(values, 0) == 1.0 and serve.percentile(values, 100) == 4.0
    assert serve.percentile(values, 50) == pytest.approx(2.5)
    assert serve.percentile([], 50) is None


def test_bench_serve_against_a_running_server_reports_every_level(tmp_path, capsys):
    srv = ServerThread(create_app(FakeEngine(max_num_seqs=4, step_delay=0.005))).start()
    out = tmp_path / "serve.json"
    try:
        argv = ["bench", "serve", "--url", f"{srv.url}/v1", "--concurrency", "1", "3"]
        rc = kiln_main(argv + ["--requests", "5", "--max-tokens", "3", "--json", str(out)])
    finally:
        srv.stop()
    assert rc == 0
    report = json.loads(out.read_text())
    levels = report["results"]
    assert [r["concurrency"] for r in levels] == [1, 3]
    for r in levels:
        assert r["completed"] == 5 and r["failed"] == 0 and r["output_tokens"] == 15
        assert r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0 and r["requests_per_s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    table = capsys.readouterr().out
    assert "| clients |" in table and "| 3 | 5/5 |" in table


def test_bench_serve_refuses_non_loopback_urls(capsys):
    rc = kiln_main(["bench", "serve", "--url", "http://example.com:8000"])
    assert rc == 2 and "loopback" in capsys.readouterr().err


def test_bench_serve_starts_its_own_server_when_given_no_url(tmp_path, monkeypatch, loaded_smollm2):
    import kiln.loaders

    monkeypatch.setattr(kiln.loaders, "load_model", lambda *a, **k: loaded_smollm2)  # skip a second load
    out = tmp_path / "spawned.json"
    argv = ["bench", "serve", "--device", "cpu", "--concurrency", "2", "--requests", "2", "--max-tokens", "3"]
    rc = kiln_main(argv + ["--json", str(out)])
    assert rc == 0
    (level,) = json.loads(out.read_text())["results"]
    assert level["completed"] == 2 and level["output_tokens"] == 6
