"""The server over a pipeline- or tensor-parallel engine whose other rank dies mid-stream: the open stream
gets an error event naming the rank, then [DONE], within the timeout (no hang), and later requests are
answered with an error at once instead of waiting on a dead group."""

import json
import os
import re
import signal
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kiln.distributed import TensorParallelEngine  # noqa: E402
from kiln.engine.config import EngineConfig  # noqa: E402
from kiln.server.app import create_app  # noqa: E402
from kiln.server.launch import ServerThread  # noqa: E402
from tests.distributed.checkpoints import write_checkpoint  # noqa: E402
from tests.distributed.test_tp_failures import _gone  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_hidden_layers=2)


def _events(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


@pytest.mark.parametrize(("tp", "pp", "named"), [(1, 2, r"rank 1, pipeline stage 1"), (2, 1, r"rank 1")])
def test_a_dead_rank_ends_the_stream_with_a_named_error_and_later_requests_fail_fast(
    checkpoint, tp, pp, named
):
    config = EngineConfig(model=checkpoint, device="cpu", num_kv_blocks=32)
    engine = TensorParallelEngine(config, tp_size=tp, pp_size=pp, timeout_s=10)
    (worker,) = engine.workers
    server = ServerThread(create_app(engine, model_name=MODEL)).start()
    try:
        body = {"model": MODEL, "prompt": "t5 t6 t7", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = _events(r)
            assert "choices" in next(events)  # generating
            os.kill(worker.pid, signal.SIGKILL)
            start = time.monotonic()
            rest = list(events)
        assert time.monotonic() - start < 30
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["code"] == "engine_error", error
        assert re.search(named, error["message"]), error["message"]
        start = time.monotonic()
        again = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=30)
        assert again.status_code >= 500 and time.monotonic() - start < 10, again.text
        assert httpx.get(f"{server.url}/health", timeout=10).status_code in (200, 503)
    finally:
        server.stop()
        engine.shutdown()
    worker.join(timeout=10)
    assert _gone(worker.pid)
