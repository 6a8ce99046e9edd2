"""tool_choice "auto" through the server with a scripted engine (its outputs spell a given reply, so the
model's own tool calls can be chosen): the official `openai` client reads the calls the hermes and
llama3_json parsers find, streamed (assembled as the client's own stream helper does) or not, content
before a call included; a reply without calls is content; the template was given the tools."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from kiln.server.app import create_app  # noqa: E402
from kiln.server.launch import ServerThread  # noqa: E402

from .fake_engine import FakeEngine, ScriptedTokenizer  # noqa: E402

MODEL = "kiln-test"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris and the time?"}]
HERMES = (
    "Checking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now", "parameters": {}}'
PYTHONIC = '[get_weather(city="Paris"), now()]'
CALLS = [("get_weather", {"city": "Paris"}), ("now", {})]


def serve(reply: str, parser: str, stop: bool = True):
    engine = FakeEngine(max_num_seqs=4, step_delay=0.001, tokenizer=ScriptedTokenizer(reply))
    engine.stop_at = len(reply) if stop else None
    srv = ServerThread(create_app(engine, model_name=MODEL, tool_call_parser=parser)).start()
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    return srv, engine, client


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize(
    "parser,reply,content",
    [("hermes", HERMES, "Checking.\n"), ("llama3_json", LLAMA3, None), ("pythonic", PYTHONIC, None)],
)
def test_auto_tool_calls_are_read_by_the_servers_parser_streamed_or_not(parser, reply, content):
    srv, engine, client = serve(reply, parser)
    try:
        kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=len(reply) + 5)
        r = client.chat.completions.create(**kw, n=2)
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == content and _calls(choice.message.tool_calls) == CALLS
            assert len({c.id for c in choice.message.tool_calls}) == 2
        with client.chat.completions.stream(**kw) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        choice = final.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert (choice.message.content or None) == content and _calls(choice.message.tool_calls) == CALLS
    finally:
        srv.stop()


def test_the_prompt_holds_the_tools_and_a_reply_without_calls_is_content():
    reply = "It is sunny in Paris."
    srv, engine, client = serve(reply, "hermes")
    try:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40)
        assert r.choices[0].message.content == reply and r.choices[0].message.tool_calls is None
        assert r.choices[0].finish_reason == "stop"
        # the template got the tools (FakeTokenizer's writes "<tool>NAME" for each)
        expected = "<tool>get_weather<tool>now<user>" + MESSAGES[0]["content"] + "<assistant>"
        assert engine.prompts == [engine.tokenizer.encode(expected)]
    finally:
        srv.stop()


def test_chat_template_kwargs_reach_the_template():
    srv, engine, client = serve("Hi.", "hermes")
    try:
        extra = {"chat_template_kwargs": {"enable_thinking": False}}
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra)
        assert r.choices[0].message.content == "Hi."
        expected = "<enable_thinking=False><user>" + MESSAGES[0]["content"] + "<assistant>"
        assert engine.prompts == [engine.tokenizer.encode(expected)]
    finally:
        srv.stop()


def test_a_reply_cut_short_inside_its_call_is_content_with_finish_reason_length():
    srv, _, client = serve(HERMES, "hermes", stop=False)
    try:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == HERMES[:40]
        assert r.choices[0].message.tool_calls is None
    finally:
        srv.stop()
