"""Server mechanics against a fake engine (no model): continuous batching across clients, one engine
thread, engine failures answered (500 / error event) without killing the loop, one request's sampling
failure answered without touching the others, bounded queue -> 503 (a request larger than the whole
queue -> 400), API keys -> 401, per-app metrics registries."""

from __future__ import annotations

import json
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from kiln.server.app import create_app  # noqa: E402
from kiln.server.launch import ServerThread  # noqa: E402

from .fake_engine import FakeEngine, FakeTokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def serve(engine, **kw):
    return ServerThread(create_app(engine, model_name=MODEL, **kw)).start()


def completion(prompt="hi", max_tokens=3, **extra):
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra}


def chat(content="hi", max_tokens=3, **extra):
    messages = [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, **extra}


def sse_payloads(response: httpx.Response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


@pytest.fixture
def engine():
    return FakeEngine(max_num_seqs=4, step_delay=0.01)


@pytest.fixture
def server(engine):
    srv = serve(engine)
    yield srv
    srv.stop()


def test_completion_text_and_usage_come_from_the_engine_outputs(server):
    body = httpx.post(f"{server.url}/v1/completions", json=completion("hello", 4), timeout=10).json()
    assert body["choices"][0]["text"] == "abcd" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_engine_failure_answers_500_and_the_loop_keeps_serving(server, engine):
    engine.fail_next_step = True
    r = httpx.post(f"{server.url}/v1/completions", json=completion(), timeout=10)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error" and "injected" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json=completion(), timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "abc"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "kiln_engine_errors_total 1.0" in metrics


def test_a_request_arriving_during_a_failing_step_is_not_failed_with_it():
    engine = FakeEngine(step_delay=1.0)  # long enough for the second request to land inside it
    srv = serve(engine)
    results = {}

    def post(name):
        results[name] = httpx.post(f"{srv.url}/v1/completions", json=completion(max_tokens=1), timeout=20)

    try:
        engine.fail_next_step = True
        first = threading.Thread(target=post, args=("in_the_step",))
        first.start()
        deadline = time.monotonic() + 5
        while not engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        post("arrived_during_it")  # queued while the failing step sleeps
        first.join()
    finally:
        srv.stop()
    assert results["in_the_step"].status_code == 500
    assert results["arrived_during_it"].status_code == 200


def test_engine_failure_mid_stream_sends_an_error_event_then_done(server, engine):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=completion(max_tokens=400, stream=True)
    ) as r:
        assert r.status_code == 200
        events = sse_payloads(r)
        first = next(events)
        assert first["choices"][0]["text"] == "a"
        engine.fail_next_step = True
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert rest[-2]["error"]["code"] == "engine_error"
    assert httpx.post(f"{server.url}/v1/completions", json=completion(), timeout=10).status_code == 200


def test_a_request_failing_in_the_sampler_fails_alone_and_the_other_streams_finish():
    """A step that raises SamplingError names the requests it could not sample: only those fail (500 /
    error event); the streams batched with them run to their last token. (Before, every request in
    flight got an error event and no finish.)"""
    engine = FakeEngine(max_num_seqs=8, step_delay=0.01)
    engine.poisoned_prompts.add(tuple(engine.tokenizer.encode("poison")))
    srv = serve(engine)
    texts, finishes, errors = {}, {}, []

    def stream(name):
        body = completion(name, 30, stream=True)
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            for event in sse_payloads(r):
                if event == "[DONE]":
                    break
                if "error" in event:
                    errors.append((name, event))
                    continue
                choice = event["choices"][0]
                texts[name] = texts.get(name, "") + choice["text"]
                finishes[name] = choice["finish_reason"]

    try:
        streams = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(3)]
        for t in streams:
            t.start()
        deadline = time.monotonic() + 5
        while len(engine.requests) < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
        bad = httpx.post(f"{srv.url}/v1/completions", json=completion("poison", 30), timeout=30)
        bad_stream = httpx.post(f"{srv.url}/v1/completions", json=completion("poison", 30, stream=True))
        for t in streams:
            t.join()
    finally:
        srv.stop()
    assert bad.status_code == 500 and bad.json()["error"]["code"] == "engine_error"
    assert "poisoned" in bad.json()["error"]["message"]
    assert '"engine_error"' in bad_stream.text and bad_stream.text.endswith("data: [DONE]\n\n")
    assert errors == []
    assert texts == {f"s{i}": "abcdefghijklmnopqrstuvwxyzabcd" for i in range(3)}  # all 30 tokens
    assert finishes == {f"s{i}": "length" for i in range(3)}
    assert not engine.requests  # the poisoned ones were aborted in the engine


@pytest.mark.parametrize("stream", [False, True])
def test_siblings_released_after_a_failure_are_not_counted_as_client_aborts(stream):
    """One prompt of a two-prompt request fails in the sampler: the handler releases its still-running
    sibling, which kiln_requests_aborted ("client went away") counted."""
    engine = FakeEngine(max_num_seqs=8, step_delay=0.01)
    engine.poisoned_prompts.add(tuple(engine.tokenizer.encode("poison")))
    srv = serve(engine)
    try:
        r = httpx.post(
            f"{srv.url}/v1/completions", json=completion(["fine", "poison"], 200, stream=stream), timeout=30
        )
        assert '"engine_error"' in r.text
        deadline = time.monotonic() + 10
        while engine.requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.requests  # the sibling was aborted in the engine all the same
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert "kiln_requests_aborted_total 0.0" in metrics
    finally:
        srv.stop()


def test_a_request_arriving_mid_generation_joins_the_running_batch():
    engine = FakeEngine(max_num_seqs=4, step_delay=0.05)  # the long request runs ~3 s
    server = serve(engine)
    late_text = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=completion("long", 60, stream=True)) as r:
        events = sse_payloads(r)
        for _ in range(3):
            next(events)
        # the long request is mid-generation; a second client arrives
        late = httpx.post(f"{server.url}/v1/completions", json=completion("late", 3), timeout=10).json()
        late_text.append(late["choices"][0]["text"])
        texts = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]")
    server.stop()
    assert late_text == ["abc"]
    assert len(texts) == 57  # the long one went on to its 60 tokens
    long_id, late_id = engine.batches[0][0], None
    joint = [b for b in engine.batches if len(b) == 2 and long_id in b]
    assert joint, "the late request never shared a step with the running one"
    late_id = next(i for i in joint[0] if i != long_id)
    assert sum(late_id in b for b in engine.batches) == 3


def test_only_the_engine_loop_thread_touches_the_engine(server, engine):
    threads = [
        threading.Thread(
            target=httpx.post, args=(f"{server.url}/v1/completions",), kwargs={"json": completion()}
        )
        for _ in range(6)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids


def test_full_queue_answers_503_and_frees_up_afterwards():
    engine = FakeEngine(max_num_seqs=1, step_delay=0.05)
    srv = serve(engine, max_queue=1)
    try:
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=completion("a", 200, stream=True)) as r1:
            events = sse_payloads(r1)  # keep it: a discarded iterator closes the stream
            next(events)
            with httpx.stream(
                "POST", f"{srv.url}/v1/completions", json=completion("b", 200, stream=True)
            ) as r2:
                assert r2.status_code == 200  # waits in the queue
                r3 = httpx.post(f"{srv.url}/v1/completions", json=completion("c", 2), timeout=10)
                assert r3.status_code == 503
                assert r3.json()["error"]["code"] == "queue_full"
                metrics = httpx.get(f"{srv.url}/metrics").text
                assert "kiln_server_sequences_in_flight 2.0" in metrics
                assert "kiln_server_sequences_capacity 2.0" in metrics
                assert 'kiln_requests_rejected_total{status="503"} 1.0' in metrics
        # both streams closed early: the server notices, releases their slots and aborts them in the engine
        deadline = time.monotonic() + 10
        while len(engine.aborted) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(engine.aborted) == 2
        assert "kiln_requests_aborted_total 2.0" in httpx.get(f"{srv.url}/metrics").text
        r4 = httpx.post(f"{srv.url}/v1/completions", json=completion("d", 2), timeout=10)
        assert r4.status_code == 200
    finally:
        srv.stop()


def test_n_greater_than_queue_capacity_is_rejected_not_queued():
    srv = serve(FakeEngine(max_num_seqs=2), max_queue=1)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json=completion(n=4), timeout=10)
        # it could never run, whatever the load: 400, not 503's "retry later"
        assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_sequences"
        assert httpx.post(f"{srv.url}/v1/completions", json=completion(n=3), timeout=10).status_code == 200
    finally:
        srv.stop()


def test_api_key_required_on_v1_routes_but_not_on_health_and_metrics():
    srv = serve(FakeEngine(), api_key="sesame")
    try:
        url = f"{srv.url}/v1/completions"
        assert httpx.post(url, json=completion()).status_code == 401
        # the key is checked before the body: no key + a bad body is still 401, not 400
        assert httpx.post(url, json={"prompt": 5}).status_code == 401
        json_type = {"Content-Type": "application/json"}
        assert httpx.post(url, content=b"{not json", headers=json_type).status_code == 401  # not even JSON
        keyed = httpx.post(url, content=b"{not json", headers={**json_type, "Authorization": "Bearer sesame"})
        assert keyed.status_code == 400 and keyed.json()["error"]["code"] == "json_invalid"
        wrong = httpx.post(url, json=completion(), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.post(url, json=completion(), headers={"Authorization": "Bearer sesame"}, timeout=10)
        assert ok.status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("root_path", ["/api", ""])
def test_api_key_is_required_behind_a_root_path_and_on_every_route_but_health_and_metrics(root_path):
    """Starlette's scope path includes the root_path (a proxy prefix, a mount): a check on the path
    starting with /v1/ let /api/v1/models through without a key."""
    from starlette.testclient import TestClient

    app = create_app(FakeEngine(), model_name=MODEL, api_key="sesame")
    with TestClient(app, root_path=root_path) as client:
        assert client.get(f"{root_path}/v1/models").status_code == 401
        assert client.post(f"{root_path}/v1/completions", json=completion()).status_code == 401
        assert client.get(f"{root_path}/openapi.json").status_code == 401
        key = {"Authorization": "Bearer sesame"}
        assert client.get(f"{root_path}/v1/models", headers=key).status_code == 200
        assert client.get(f"{root_path}/health").status_code == 200
        assert client.get(f"{root_path}/metrics").status_code == 200


def test_two_apps_keep_separate_metrics(server):
    other = serve(FakeEngine())
    try:
        httpx.post(f"{server.url}/v1/completions", json=completion(max_tokens=5), timeout=10)
        mine = httpx.get(f"{server.url}/metrics").text
        theirs = httpx.get(f"{other.url}/metrics").text
        assert 'kiln_requests_finished_total{finish_reason="length"} 1.0' in mine
        assert 'finish_reason="length"' not in theirs
        assert "kiln_time_to_first_token_seconds_count 1.0" in mine
        assert "kiln_inter_token_latency_seconds_count 4.0" in mine
    finally:
        other.stop()


def test_unknown_route_gets_an_openai_error_body(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_an_app_started_again_after_a_stop_serves_again():
    from starlette.testclient import TestClient

    app = create_app(FakeEngine(), model_name=MODEL)
    for _ in range(2):  # the lifespan stops the engine loop and the tokenizer threads; both restart
        with TestClient(app) as client:
            r = client.post("/v1/completions", json=completion(max_tokens=2))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


def test_streams_ask_for_delta_outputs_and_other_requests_for_one_final_output(server, engine):
    """A stream gets each engine output's new tokens (the engine's delta outputs); a non-streaming
    request one output a choice (final_only), not one a step that the server would only collect."""
    before = engine.outputs
    r = httpx.post(f"{server.url}/v1/completions", json=completion("hi", 6, n=2), timeout=10)
    assert [c["text"] for c in r.json()["choices"]] == ["abcdef", "abcdef"]
    assert engine.outputs - before == 2 and {p.output_kind for p in engine.params[-2:]} == {"final_only"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=completion("hi", 6, stream=True)) as r:
        texts = [e["choices"][0]["text"] for e in sse_payloads(r) if e != "[DONE]"]
    assert texts == list("abcdef") and engine.params[-1].output_kind == "delta"


def test_latency_metrics_count_every_token_of_streamed_and_final_only_requests(engine):
    """With delta outputs a token count per output is the new tokens, not the total: the engine loop
    counted inter-token gaps as if no token had come since the first."""
    srv = serve(engine)
    try:
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json=completion("s", 5, stream=True), timeout=10
        ) as r:
            list(sse_payloads(r))
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert "kiln_time_to_first_token_seconds_count 1.0" in metrics
        assert "kiln_inter_token_latency_seconds_count 4.0" in metrics
        httpx.post(f"{srv.url}/v1/completions", json=completion("f", 7), timeout=10)  # final_only
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert "kiln_time_to_first_token_seconds_count 2.0" in metrics
        assert "kiln_inter_token_latency_seconds_count 10.0" in metrics  # 4 + 6 gaps
        line = next(m for m in metrics.splitlines() if m.startswith("kiln_inter_token_latency_seconds_sum"))
        gaps = float(line.split()[1])
        assert 10 * 0.005 <= gaps < 10.0  # each gap is at least a step (10 ms each)
    finally:
        srv.stop()


def test_a_stream_of_several_choices_matches_the_non_streamed_response(server):
    """Per choice index: the streamed texts concatenate to the non-streamed text, with the same finish
    reason, logprobs tokens and text offsets; the usage chunk counts the same tokens."""
    body = completion(["hi", "there"], 5, n=2, logprobs=1)
    plain = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10).json()
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=10) as r:
        events = [e for e in sse_payloads(r) if e != "[DONE]"]
    streamed: dict[int, dict] = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        mine = streamed.setdefault(choice["index"], {"text": "", "tokens": [], "text_offset": []})
        mine["text"] += choice["text"]
        mine["tokens"] += choice["logprobs"]["tokens"]
        mine["text_offset"] += choice["logprobs"]["text_offset"]
        mine["finish_reason"] = choice["finish_reason"]
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in plain["choices"]:
        mine = streamed[choice["index"]]
        assert mine["text"] == choice["text"] and mine["finish_reason"] == choice["finish_reason"]
        assert mine["tokens"] == choice["logprobs"]["tokens"]
        assert mine["text_offset"] == choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    assert plain["usage"]["completion_tokens"] == 20


def test_every_chunk_of_a_stream_has_the_created_time_of_its_start():
    """`created` was read again for each chunk: a stream longer than a second changed it mid-way."""
    engine = FakeEngine(step_delay=0.1)
    srv = serve(engine)
    try:
        body = completion("hi", 14, stream=True)  # ~1.4 s: crosses a second boundary
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=30) as r:
            created = {e["created"] for e in sse_payloads(r) if e != "[DONE]"}
        assert len(created) == 1
    finally:
        srv.stop()


def strict_json(text: str):
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_a_minus_infinity_logprob_is_written_as_minus_9999(server, stream):
    """A token the model rules out has logprob -inf: the JSON response failed (500, as JSON has no
    infinity) and a stream wrote -Infinity, which JSON readers refuse. OpenAI and vLLM write -9999.0."""
    for path, body in (
        ("/v1/completions", completion("hi", 2, logprobs=3, stream=stream)),
        ("/v1/chat/completions", chat("hi", 2, logprobs=True, top_logprobs=3, stream=stream)),
    ):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=10)
        assert r.status_code == 200, r.text
        if stream:
            payloads = [strict_json(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        else:
            payloads = [strict_json(r.text)]
        choices = [c for p in payloads for c in p["choices"] if c.get("logprobs")]
        assert choices
        for c in choices:
            if "content" in c["logprobs"]:
                values = [t["logprob"] for e in c["logprobs"]["content"] for t in e["top_logprobs"]]
            else:
                values = [v for top in c["logprobs"]["top_logprobs"] for v in top.values()]
            assert -9999.0 in values and min(values) == -9999.0


def test_a_dead_engine_loop_fails_requests_fast_with_503():
    """The engine loop thread died (an exception past its guard): requests in flight got no answer,
    and every later request waited forever on a queue nobody reads."""
    engine = FakeEngine(step_delay=0.02)
    srv = serve(engine)
    try:
        with httpx.stream(
            "POST", f"{srv.url}/v1/completions", json=completion("hi", 500, stream=True), timeout=30
        ) as r:
            events = sse_payloads(r)
            next(events)
            engine.die_next_step = True
            rest = list(events)
        assert rest[-1] == "[DONE]" and rest[-2]["error"]["code"] == "engine_error"
        assert "died" in rest[-2]["error"]["message"]
        for path, body in (
            ("/v1/completions", completion()),
            ("/v1/chat/completions", chat()),
            ("/v1/completions", completion(stream=True)),
        ):
            start = time.monotonic()
            r = httpx.post(f"{srv.url}{path}", json=body, timeout=10)
            assert time.monotonic() - start < 2
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "engine_stopped" and "engine loop stopped" in error["message"]
        assert httpx.get(f"{srv.url}/health").status_code == 503
    finally:
        srv.stop()


class RecordingTokenizer(FakeTokenizer):
    def __init__(self):
        self.conversations = []

    def apply_chat_template(self, messages, add_generation_prompt=True):
        self.conversations.append(messages)
        return super().apply_chat_template(messages, add_generation_prompt)


def test_chat_text_parts_are_joined_with_newlines_as_vllm_joins_them():
    tokenizer = RecordingTokenizer()
    srv = serve(FakeEngine(tokenizer=tokenizer))
    try:
        parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=chat(parts), timeout=10).status_code == 200
        assert tokenizer.conversations[-1] == [{"role": "user", "content": "first\nsecond"}]
    finally:
        srv.stop()


def test_a_prompt_of_token_id_lists_is_a_batch_of_prompts(server, engine):
    body = completion([[5, 6, 7], [8]], 2, echo=True)
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["efgab", "hab"]  # echoed: the decoded ids
    assert body["usage"]["prompt_tokens"] == 4
    for prompt in ([[5], []], [[]]):
        r = httpx.post(f"{server.url}/v1/completions", json=completion(prompt), timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("prompt")
