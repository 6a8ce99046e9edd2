"""Request checks against a fake engine (no model): strict types, ranges and cross-field rules give 400
with the parameter named; cheap checks (model, size of the request) run before tokenization; a body
over the limit gets 413 before it is read; text that is not Unicode and unexpected errors leave the
connection usable, and a 500 says nothing of the exception."""

from __future__ import annotations

import json

import httpx
import pytest

from kiln.engine.sampling_params import StructuredOutputsParams
from kiln.server.app import create_app
from kiln.server.launch import ServerThread

from .fake_engine import FakeEngine, FakeTokenizer

MODEL = "SmolLM2-135M-Instruct"


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def completion(**fields):
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | fields


class CountingTokenizer(FakeTokenizer):
    """Counts encode calls; raises on the text "explode" (an unexpected bug inside the server)."""

    def __init__(self):
        self.encoded = 0

    def encode(self, text, add_special_tokens=True):
        if text == "explode":
            raise RuntimeError("secret internal detail")
        self.encoded += 1
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return CountingTokenizer()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(max_num_seqs=2, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def server(engine):
    # capacity: 2 running + 1 queued sequences
    srv = ServerThread(create_app(engine, model_name=MODEL, max_queue=1)).start()
    yield srv
    srv.stop()


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param, error
    return error


BAD_FIELDS = {
    # strict types: JSON true is not an integer, "2" is not a number
    "max_tokens_true": ("/v1/completions", completion(max_tokens=True), "max_tokens"),
    "n_string": ("/v1/completions", completion(n="2"), "n"),
    "temperature_string": ("/v1/completions", completion(temperature="0.5"), "temperature"),
    "temperature_true": ("/v1/completions", completion(temperature=True), "temperature"),
    "stream_string": ("/v1/completions", completion(stream="true"), "stream"),
    "echo_one": ("/v1/completions", completion(echo=1), "echo"),
    "logprobs_true": ("/v1/completions", completion(logprobs=True), "logprobs"),
    "seed_float": ("/v1/completions", completion(seed=1.0), "seed"),
    "prompt_ids_with_a_bool": ("/v1/completions", completion(prompt=[1, True]), "prompt"),
    "chat_logprobs_one": ("/v1/chat/completions", chat(logprobs=1), "logprobs"),
    "include_usage_string": (
        "/v1/completions",
        completion(stream=True, stream_options={"include_usage": "yes"}),
        "stream_options.include_usage",
    ),
    # ranges: what the generator takes, what the filters mean
    "seed_past_the_generator": ("/v1/completions", completion(seed=2**64, temperature=1), "seed"),
    "seed_below_the_generator": ("/v1/completions", completion(seed=-(2**63) - 1), "seed"),
    # NaN and Infinity: Python's JSON reader takes them; "not finite", not "less than or equal to 2"
    "temperature_nan": ("/v1/completions", completion(temperature=float("nan")), "temperature"),
    "top_p_infinity": ("/v1/chat/completions", chat(top_p=float("inf")), "top_p"),
    "min_p_minus_infinity": ("/v1/completions", completion(min_p=float("-inf")), "min_p"),
    "stop_token_id_negative": ("/v1/completions", completion(stop_token_ids=[5, -1]), "stop_token_ids[1]"),
    "stop_token_id_not_an_int": ("/v1/chat/completions", chat(stop_token_ids=["."]), "stop_token_ids[0]"),
    "too_many_stop_token_ids": ("/v1/completions", completion(stop_token_ids=[1] * 257), "stop_token_ids"),
    # vLLM's rule: stream_options only with stream true
    "stream_options_without_stream": (
        "/v1/completions",
        completion(stream_options={"include_usage": True}),
        "stream_options",
    ),
    "chat_stream_options_stream_false": (
        "/v1/chat/completions",
        chat(stream=False, stream_options={"include_usage": False}),
        "stream_options",
    ),
    "top_k_minus_two": ("/v1/completions", completion(top_k=-2), "top_k"),
    "too_many_stop_strings": ("/v1/completions", completion(stop=["x"] * 17), "stop"),
    "chat_text_part_not_text": (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        "messages[0].content",
    ),
    # OpenAI's rule: top_logprobs only with logprobs
    "top_logprobs_without_logprobs": ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    # parts other than text would be dropped: the model would answer another message
    "chat_image_part": (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        "messages[0].content",
    ),
    "chat_part_without_type": (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"text": "describe"}]}]),
        "messages[0].content",
    ),
    # penalties, logit_bias and min_tokens outside their ranges
    "logit_bias_too_large": ("/v1/completions", completion(logit_bias={"5": 100.5}), "logit_bias"),
    "logit_bias_key_not_a_token_id": ("/v1/completions", completion(logit_bias={"a5": 1}), "logit_bias"),
    "logit_bias_negative_key": ("/v1/chat/completions", chat(logit_bias={"-5": 1}), "logit_bias"),
    "logit_bias_not_a_number": ("/v1/completions", completion(logit_bias={"5": "high"}), "logit_bias"),
    "logit_bias_too_many": (
        "/v1/completions",
        completion(logit_bias={str(i): 1 for i in range(1025)}),
        "logit_bias",
    ),
    "presence_penalty_above_2": ("/v1/chat/completions", chat(presence_penalty=2.5), "presence_penalty"),
    "frequency_penalty_below_minus_2": (
        "/v1/completions",
        completion(frequency_penalty=-2.01),
        "frequency_penalty",
    ),
    "frequency_penalty_bool": ("/v1/completions", completion(frequency_penalty=True), "frequency_penalty"),
    "repetition_penalty_zero": ("/v1/completions", completion(repetition_penalty=0), "repetition_penalty"),
    "repetition_penalty_nan": (
        "/v1/completions",
        completion(repetition_penalty=float("nan")),
        "repetition_penalty",
    ),
    "min_tokens_negative": ("/v1/completions", completion(min_tokens=-1), "min_tokens"),
    "min_tokens_above_max_tokens": ("/v1/completions", completion(min_tokens=3), "min_tokens"),
    "min_tokens_chat_above_max_tokens": ("/v1/chat/completions", chat(min_tokens=5), "min_tokens"),
    # fields this server does not implement, at values that would change the output
    "best_of": ("/v1/completions", completion(best_of=5), "best_of"),
    "suffix": ("/v1/completions", completion(suffix="end"), "suffix"),
    # output constraints: the shapes OpenAI and vLLM define, one at a time
    "response_format_unknown_type": (
        "/v1/chat/completions",
        chat(response_format={"type": "xml"}),
        "response_format.type",
    ),
    "response_format_schema_missing": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema"}),
        "response_format",
    ),
    "response_format_schema_not_an_object": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
        "response_format.json_schema.schema",
    ),
    "structured_outputs_two_kinds": (
        "/v1/chat/completions",
        chat(structured_outputs={"choice": ["a", "b"], "regex": "a"}),
        "structured_outputs",
    ),
    "structured_outputs_none": ("/v1/completions", completion(structured_outputs={}), "structured_outputs"),
    "structured_outputs_unknown_key": (
        "/v1/completions",
        completion(structured_outputs={"regex": "a", "backend": "outlines"}),
        "structured_outputs.backend",
    ),
    "structured_outputs_empty_choice": (
        "/v1/completions",
        completion(structured_outputs={"choice": ["a", ""]}),
        "structured_outputs",
    ),
    "structured_outputs_json_text_not_json": (
        "/v1/completions",
        completion(structured_outputs={"json": "{not json"}),
        "structured_outputs",
    ),
    "two_constraints": (
        "/v1/chat/completions",
        chat(response_format={"type": "json_object"}, guided_regex="[ab]+"),
        "guided_regex",
    ),
    "guided_choice_empty": ("/v1/completions", completion(guided_choice=[]), "guided_choice"),
    # tool calling: auto needs the server's parser; named and required need tools of those names
    "tools_auto_without_a_parser": ("/v1/chat/completions", chat(tools=[TOOL]), "tool_choice"),
    "tool_choice_required_without_tools": (
        "/v1/chat/completions",
        chat(tool_choice="required"),
        "tool_choice",
    ),
    "tool_choice_named_unknown": (
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice",
    ),
    "tool_choice_unknown_word": (
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice="sometimes"),
        "tool_choice",
    ),
    "tools_two_of_one_name": ("/v1/chat/completions", chat(tools=[TOOL, TOOL], tool_choice="none"), "tools"),
    "tool_name_with_a_space": (
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "get weather"}}], tool_choice="none"),
        "tools[0].function.name",
    ),
    "tool_choice_and_response_format": (
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "tool_choice",
    ),
    "tool_call_arguments_not_text": (
        "/v1/chat/completions",
        chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]),
        "messages[0].tool_calls[0].function.arguments",
    ),
    "completion_tools": ("/v1/completions", completion(tools=[TOOL]), "tools"),
    # vLLM's extensions this server does not implement: ignoring them answered another request
    "prompt_logprobs": ("/v1/completions", completion(prompt_logprobs=1), "prompt_logprobs"),
    "guided_any_other": ("/v1/completions", completion(guided_something_new="x"), "guided_something_new"),
    "guided_whitespace_pattern": (
        "/v1/completions",
        completion(guided_regex="a", guided_whitespace_pattern=" "),
        "guided_whitespace_pattern",
    ),
    "include_stop_str_in_output_not_a_bool": (
        "/v1/completions",
        completion(include_stop_str_in_output=1, stop=["x"]),
        "include_stop_str_in_output",
    ),
    "skip_special_tokens_false": (
        "/v1/completions",
        completion(skip_special_tokens=False),
        "skip_special_tokens",
    ),
    "allowed_token_ids_empty": ("/v1/completions", completion(allowed_token_ids=[]), "allowed_token_ids"),
    "allowed_token_ids_negative": (
        "/v1/chat/completions",
        chat(allowed_token_ids=[3, -1]),
        "allowed_token_ids[1]",
    ),
    "bad_words_blank": ("/v1/chat/completions", chat(bad_words=["no", " \t"]), "bad_words"),
    "bad_words_too_many": ("/v1/completions", completion(bad_words=["w"] * 129), "bad_words"),
    "bad_words_too_long": ("/v1/completions", completion(bad_words=["w" * 513]), "bad_words[0]"),
    "truncate_prompt_tokens": (
        "/v1/completions",
        completion(truncate_prompt_tokens=5),
        "truncate_prompt_tokens",
    ),
    "use_beam_search": ("/v1/completions", completion(use_beam_search=True), "use_beam_search"),
    "chat_template_kwargs": (
        "/v1/chat/completions",
        chat(chat_template_kwargs={"enable_thinking": False, "messages": []}),
        "chat_template_kwargs",
    ),
    "chat_template": ("/v1/chat/completions", chat(chat_template="{{ messages }}"), "chat_template"),
    "chat_echo": ("/v1/chat/completions", chat(echo=True), "echo"),
    "continue_final_message": (
        "/v1/chat/completions",
        chat(continue_final_message=True),
        "continue_final_message",
    ),
    "add_generation_prompt_false": (
        "/v1/chat/completions",
        chat(add_generation_prompt=False),
        "add_generation_prompt",
    ),
    "return_tokens_as_token_ids": (
        "/v1/completions",
        completion(return_tokens_as_token_ids=True),
        "return_tokens_as_token_ids",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FIELDS))
def test_bad_field_gets_400_naming_the_parameter(server, case):
    path, body, param = BAD_FIELDS[case]
    raw = json.dumps(body)  # NaN and Infinity as Python's JSON writes them (httpx's json= refuses them)
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400, param)
    assert error["message"].startswith(f"{param}: "), error
    if case.endswith(("_nan", "_infinity")):
        assert "finite" in error["message"], error


def test_the_refusals_say_what_to_send_instead(server):
    r = httpx.post(f"{server.url}/v1/completions", json=completion(use_beam_search=True))
    assert "send false" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json=completion(stream_options={"include_usage": True}))
    assert "only be defined when stream is true" in r.json()["error"]["message"]


def test_accepted_edges_of_the_ranges(server, engine):
    # the top of the seed range with n = 2: the second choice's seed wraps to 0
    r = httpx.post(f"{server.url}/v1/completions", json=completion(seed=2**64 - 1, n=2, temperature=1))
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    for body in (completion(temperature=1), completion(top_k=-1), completion(top_k=10**30)):
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=10).status_code == 200
    # top_k 0 is off, as vLLM reads it (it was a 400)
    assert httpx.post(f"{server.url}/v1/completions", json=completion(top_k=0)).status_code == 200
    assert engine.params[-1].top_k == -1
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(logprobs=True, top_logprobs=2))
    assert r.status_code == 200
    # the unimplemented fields at the values that change nothing, as clients send them by default, and
    # the penalties at theirs (or null)
    neutral = dict(
        logit_bias={}, presence_penalty=0, frequency_penalty=None, repetition_penalty=1, min_tokens=None,
        response_format={"type": "text"}, tools=[], tool_choice="none", functions=None,
    )  # fmt: skip
    assert httpx.post(f"{server.url}/v1/chat/completions", json=chat(**neutral)).status_code == 200
    body = completion(best_of=2, n=2, suffix="", logit_bias=None, temperature=1)
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    # vLLM's extensions at their neutral values (or null)
    neutral = dict(
        prompt_logprobs=None, guided_json=None, structured_outputs=None, include_stop_str_in_output=False,
        skip_special_tokens=True, allowed_token_ids=None, bad_words=[], truncate_prompt_tokens=None,
        use_beam_search=False, stop_token_ids=[], ignore_eos=True,
    )  # fmt: skip
    assert httpx.post(f"{server.url}/v1/completions", json=completion(**neutral)).status_code == 200
    chat_neutral = dict(
        neutral, echo=False, continue_final_message=False, add_generation_prompt=True,
        chat_template_kwargs={}, stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(**chat_neutral))
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    r = httpx.post(f"{server.url}/v1/completions", json=completion(echo=True))  # echo without logprobs
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hiab"


def test_stop_token_ids_reach_the_engine(server, engine):
    """stop_token_ids (vLLM's extension, which the engine implements) was accepted and dropped."""
    r = httpx.post(f"{server.url}/v1/completions", json=completion(stop_token_ids=[7, 30]))
    assert r.status_code == 200 and engine.params[-1].stop_token_ids == [7, 30]
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(stop_token_ids=[0]))
    assert r.status_code == 200 and engine.params[-1].stop_token_ids == [0]


def test_penalties_logit_bias_and_min_tokens_reach_the_engine(server, engine):
    """They were refused unless neutral; now each request's SamplingParams carries them (n choices
    alike), logit_bias with integer token ids, and the defaults (or null) leave them off."""
    body = completion(
        n=2, max_tokens=4, presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.3, min_tokens=4,
        logit_bias={"7": -100, "0012": 2.5}, allowed_token_ids=[4, 7, 9], bad_words=["no", "never"],
    )  # fmt: skip
    assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 200
    for params in engine.params[-2:]:
        penalties = (params.presence_penalty, params.frequency_penalty, params.repetition_penalty)
        assert penalties == (-2, 1.5, 1.3)
        assert params.logit_bias == {7: -100.0, 12: 2.5} and params.min_tokens == 4
        assert params.allowed_token_ids == [4, 7, 9] and params.bad_words == ["no", "never"]
        assert not params.include_stop_str_in_output
    body = chat(presence_penalty=None, frequency_penalty=None, repetition_penalty=None, logit_bias=None)
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body).status_code == 200
    params = engine.params[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0, 0, 1)
    assert params.logit_bias is None and params.min_tokens == 0 and params.allowed_token_ids is None
    assert not params.adjusts_logits


def test_each_form_of_output_constraint_reaches_the_engine_as_its_structured_outputs(server, engine):
    """OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields: each request's
    SamplingParams carry the same StructuredOutputsParams (n choices alike); {"type": "text"} is none."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    named = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    yes_no, grammar, as_json = ["yes", "no"], 'root ::= "a"', {"json": schema}
    cases = [
        ("/v1/chat/completions", chat(response_format={"type": "json_object"}), {"json_object": True}),
        ("/v1/chat/completions", chat(response_format=named), as_json),
        ("/v1/completions", completion(structured_outputs={"json": schema, "disable_any_whitespace": True}),
         {"json": schema, "disable_any_whitespace": True}),
        ("/v1/completions", completion(structured_outputs={"regex": "[ab]+"}), {"regex": "[ab]+"}),
        ("/v1/chat/completions", chat(structured_outputs={"choice": yes_no}), {"choice": yes_no}),
        ("/v1/completions", completion(structured_outputs={"grammar": grammar}), {"grammar": grammar}),
        ("/v1/completions", completion(structured_outputs={"json_object": True}), {"json_object": True}),
        ("/v1/chat/completions", chat(guided_json=schema), {"json": schema}),
        ("/v1/completions", completion(guided_regex="[ab]+"), {"regex": "[ab]+"}),
        ("/v1/completions", completion(guided_grammar='root ::= "a"'), {"grammar": 'root ::= "a"'}),
        ("/v1/completions", completion(guided_choice=["yes", "no"], n=2), {"choice": ["yes", "no"]}),
    ]  # fmt: skip
    for path, body, expected in cases:
        r = httpx.post(f"{server.url}{path}", json=body)
        assert r.status_code == 200, r.text
        assert engine.params[-1].structured_outputs == StructuredOutputsParams(**expected), body
    assert engine.params[-2].structured_outputs == engine.params[-1].structured_outputs  # n = 2
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(response_format={"type": "text"}))
    assert r.status_code == 200 and engine.params[-1].structured_outputs is None


def test_a_request_that_can_never_fit_is_400_and_is_not_tokenized(server, tokenizer):
    """100 prompts x n = 16 can never run on a server holding 3 sequences: not 503 "retry later"."""
    before = tokenizer.encoded
    r = httpx.post(f"{server.url}/v1/completions", json=completion(prompt=["x"] * 100, n=16), timeout=10)
    error = assert_openai_error(r, 400, "n")
    assert error["code"] == "too_many_sequences" and "1600" in error["message"]
    assert_openai_error(
        httpx.post(f"{server.url}/v1/completions", json=completion(prompt=["x"] * 4)), 400, "prompt"
    )
    assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions", json=chat(n=4)), 400, "n")
    assert tokenizer.encoded == before


def test_unknown_model_is_refused_before_tokenizing(server, tokenizer):
    before = tokenizer.encoded
    r = httpx.post(f"{server.url}/v1/completions", json=completion(model="gpt-4", prompt="long " * 10_000))
    assert assert_openai_error(r, 400, "model")["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat(model="gpt-4"))
    assert assert_openai_error(r, 400, "model")["code"] == "model_not_found"
    assert tokenizer.encoded == before


def local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("client_addr")[1]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", completion(prompt="a\ud800"), "prompt"),
        ("/v1/completions", completion(prompt=["ok", "\udfff"]), "prompt[1]"),
        (
            "/v1/chat/completions",
            chat(messages=[{"role": "user", "content": "\ud800"}]),
            "messages[0].content",
        ),
        ("/v1/completions", completion(stop="\ud83d"), "stop"),
    ],
)
def test_lone_surrogate_gets_400_and_the_connection_stays_open(server, path, body, param):
    """JSON may spell a lone surrogate, which is not Unicode: it gave a 500 with the exception's text
    and a closed connection."""
    with httpx.Client(base_url=server.url, timeout=10) as client:
        raw = json.dumps(body)  # ensure_ascii spells the surrogate "\\ud800", as a client would
        r = client.post(path, content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, param)
        again = client.post("/v1/completions", json=completion())
        assert again.status_code == 200 and local_port(again) == local_port(r)


def test_unexpected_error_is_a_500_that_hides_the_exception_and_keeps_the_connection(server):
    with httpx.Client(base_url=server.url, timeout=10) as client:
        r = client.post("/v1/completions", json=completion(prompt="explode"))
        error = assert_openai_error(r, 500)
        assert error["code"] == "internal_error" and "secret" not in r.text
        again = client.post("/v1/completions", json=completion())
        assert again.status_code == 200 and local_port(again) == local_port(r)


def test_body_over_the_limit_gets_413_before_it_is_read():
    tokenizer = CountingTokenizer()
    srv = ServerThread(
        create_app(FakeEngine(tokenizer=tokenizer), model_name=MODEL, max_body_bytes=1000)
    ).start()
    try:
        big = completion(prompt="x" * 2000)
        r = httpx.post(f"{srv.url}/v1/completions", json=big)
        assert assert_openai_error(r, 413)["code"] == "request_too_large"

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"model": "%s", "prompt": "' % MODEL.encode()
            for _ in range(20):
                yield b"x" * 100
            yield b'"}'

        r = httpx.post(
            f"{srv.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert assert_openai_error(r, 413)["code"] == "request_too_large"
        assert tokenizer.encoded == 0
        fits = completion(prompt="x" * 800)
        assert httpx.post(f"{srv.url}/v1/completions", json=fits, timeout=10).status_code == 200
        assert 'kiln_requests_rejected_total{status="413"} 2.0' in httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()
