"""`kiln serve` on the embedded SmolLM2 under abuse: clients that disconnect (their KV blocks come
back, seen through /metrics), malformed and out-of-range requests (400 with OpenAI's error body,
and the server keeps serving), wrong API keys (401), a full queue (503), an engine step that
raises (500, and the loop goes on)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from kiln.server.app import DEFAULT_MODEL_NAME as MODEL

KEY = "robust-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(start_server):
    srv, app = start_server(api_key=KEY, max_num_seqs=4, num_kv_blocks=64)  # max_model_len = 1024
    yield srv, app
    srv.stop()


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_for(predicate, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def still_serving(server) -> None:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        headers=AUTH,
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def long_request(stream: bool) -> dict:
    return {
        "model": MODEL,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def test_client_disconnect_mid_stream_aborts_and_frees_its_kv_blocks(server):
    aborted_before = metric(server, "kiln_requests_aborted_total")
    with httpx.stream("POST", f"{server.url}/v1/completions", json=long_request(True), headers=AUTH) as r:
        lines = r.iter_lines()
        data = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
        assert data and "[DONE]" not in data
        assert wait_for(lambda: metric(server, "kiln_kv_cache_blocks_used") > 0)
    # the connection is closed after a few tokens, ~395 tokens before the request would end
    assert wait_for(lambda: metric(server, "kiln_kv_cache_blocks_used") == 0)
    assert metric(server, "kiln_requests_running") == 0
    assert metric(server, "kiln_requests_aborted_total") == aborted_before + 1
    still_serving(server)


def test_client_that_gives_up_on_a_non_streaming_request_frees_its_kv_blocks(server):
    aborted_before = metric(server, "kiln_requests_aborted_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long_request(False), headers=AUTH, timeout=1.5)
    assert wait_for(lambda: metric(server, "kiln_requests_aborted_total") == aborted_before + 1)
    assert wait_for(lambda: metric(server, "kiln_kv_cache_blocks_used") == 0)
    still_serving(server)


def completion(**fields):
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


BAD_REQUESTS = {
    "malformed_json": ("/v1/completions", '{"model": "SmolLM2-135M-Instruct", "prompt": '),
    "body_not_an_object": ("/v1/completions", [1, 2]),
    "unknown_model": ("/v1/completions", completion(model="gpt-4")),
    "missing_prompt": ("/v1/completions", {"model": MODEL}),
    "max_tokens_wrong_type": ("/v1/completions", completion(max_tokens="many")),
    "temperature_wrong_type": ("/v1/completions", completion(temperature="hot")),
    "max_tokens_zero": ("/v1/completions", completion(max_tokens=0)),
    "max_tokens_negative": ("/v1/completions", completion(max_tokens=-5)),
    "prompt_plus_max_tokens_past_context": ("/v1/completions", completion(max_tokens=1024)),
    "prompt_alone_past_context": ("/v1/completions", completion(prompt="word " * 1100, max_tokens=1)),
    "empty_prompt": ("/v1/completions", completion(prompt="")),
    "token_id_out_of_vocab": ("/v1/completions", completion(prompt=[1, 10**9])),
    "top_p_out_of_range": ("/v1/completions", completion(top_p=0)),
    "chat_messages_not_a_list": ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}),
    "chat_unknown_role": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard"}]}),
    "chat_max_tokens_zero": (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_400_with_an_openai_error_body_and_the_server_keeps_serving(server, case):
    path, body = BAD_REQUESTS[case]
    if isinstance(body, str):
        r = httpx.post(
            f"{server.url}{path}", content=body, headers={**AUTH, "content-type": "application/json"}
        )
    else:
        r = httpx.post(f"{server.url}{path}", json=body, headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health").status_code == 200
    if case in ("malformed_json", "prompt_plus_max_tokens_past_context", "unknown_model"):
        still_serving(server)  # a generation right after, for a few representative cases


def test_wrong_or_missing_api_key_gets_401(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert info.value.status_code == 401
    r = httpx.post(f"{server.url}/v1/completions", json=completion())
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    still_serving(server)


def test_full_queue_gets_503_from_the_real_engine(start_server):
    srv, _ = start_server(max_num_seqs=1, max_queue=0, num_kv_blocks=64)
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=long_request(True)) as r:
            lines = r.iter_lines()
            next(lines)  # running: the one slot is taken, and no queue is allowed
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert info.value.status_code == 503
            assert info.value.body["code"] == "queue_full"
        # the stream is gone: its slot is freed as soon as the server notices the disconnect
        assert wait_for(lambda: metric(srv, "kiln_requests_aborted_total") == 1)
        assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices
    finally:
        srv.stop()


def test_engine_step_exception_fails_the_request_with_500_and_the_loop_goes_on(served):
    server, app = served
    engine = app.state.async_engine.engine
    real_step = engine.step

    def failing_step():
        engine.step = real_step  # fail once
        raise RuntimeError("simulated device error")

    engine.step = failing_step
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=completion(), headers=AUTH, timeout=60)
    finally:
        engine.step = real_step
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error" and "simulated" in r.json()["error"]["message"]
    assert wait_for(lambda: metric(server, "kiln_kv_cache_blocks_used") == 0)
    still_serving(server)
