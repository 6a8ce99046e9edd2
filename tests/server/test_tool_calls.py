"""Tool calling's reply side without a model: the hermes and llama3_json parsers on replies in each
format (known answers), and the streamed deltas of every mode, fed in every split of the reply, equal
the non-streamed message and finish reason."""

from __future__ import annotations

import json
import random

import pytest

from kiln.server.tool_calls import ToolReplies, required_calls
from kiln.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, PythonicToolParser, tool_parser

WEATHER = {"city": "Paris", "unit": "celsius"}


def hermes_call(name: str, arguments: dict) -> str:
    # the form Hermes 2 Pro / Qwen2.5 chat templates write an assistant's calls in
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


HERMES_CASES = [
    # reply, expected (content, [(name, arguments dict)]) or None (no calls: all content)
    (hermes_call("get_weather", WEATHER), (None, [("get_weather", WEATHER)])),
    (
        "Let me check both.\n"
        + hermes_call("get_weather", WEATHER)
        + "\n"
        + hermes_call("add", {"a": 1, "b": 2}),
        ("Let me check both.\n", [("get_weather", WEATHER), ("add", {"a": 1, "b": 2})]),
    ),
    # the reply ended inside its last call (a stop at </tool_call>, or the model's EOS there)
    ('<tool_call>\n{"name": "now", "arguments": {}}', (None, [("now", {})])),
    ("The weather is fine, thanks.", None),
    ("<tool_call>\n{not json}\n</tool_call>", None),
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', None),  # no name: not a call
    ("Mentions <tool_ but never calls", None),
    (
        '<tool_call>{"name": "café", "arguments": {"q": "東京"}}</tool_call>',
        (None, [("café", {"q": "東京"})]),
    ),
]

LLAMA3_CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        (None, [("get_weather", WEATHER)]),
    ),
    (
        '  {"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        (None, [("a", {"x": 1}), ("b", {})]),
    ),
    ('<|python_tag|>{"name": "a", "arguments": {"x": 1}}', (None, [("a", {"x": 1})])),
    ("Paris is sunny today.", None),
    ('{"name": "a", "parameters": {}} and then some text', None),
    ('{"name": "a", "parameters": ', None),  # cut short
    ("   ", None),
]


PYTHONIC_CASES = [
    ('[get_weather(city="Paris", unit="celsius")]', (None, [("get_weather", WEATHER)])),
    (
        "\n[a(x=[1, 2.5], y={'k': None, 'b': True}), now()]",
        (None, [("a", {"x": [1, 2.5], "y": {"k": None, "b": True}}), ("now", {})]),
    ),
    ("It is [probably] sunny.", None),
    ("[f(1)]", None),  # positional arguments: not this format
    ('[__import__("os").system("ls")]', None),  # never evaluated: not a call of a plain name
    ('[f(a=open("x"))]', None),  # a value that is not a literal
    ("[f(a=1e999)]", None),  # no JSON for it
    ("[f(**kw)]", None),
    ("[]", None),
    ("[f(a=1)", None),  # cut short
]


def _decoded(found):
    if found is None:
        return None
    content, calls = found
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


@pytest.mark.parametrize("reply,expected", HERMES_CASES)
def test_hermes_parser_reads_the_calls_hermes_templates_write(reply, expected):
    assert _decoded(HermesToolParser().extract(reply)) == expected


@pytest.mark.parametrize("reply,expected", LLAMA3_CASES)
def test_llama3_json_parser_reads_llama_json_tool_calls(reply, expected):
    assert _decoded(Llama3JsonToolParser().extract(reply)) == expected


@pytest.mark.parametrize("reply,expected", PYTHONIC_CASES)
def test_pythonic_parser_reads_calls_by_keyword_with_literal_values_only(reply, expected):
    assert _decoded(PythonicToolParser().extract(reply)) == expected


def test_arguments_given_as_text_stay_that_text_and_unknown_parsers_are_named():
    found = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert found == (None, [("f", '{"a": 1}')])
    with pytest.raises(ValueError, match="'mistral' is unknown; known: hermes, llama3_json, pythonic"):
        tool_parser("mistral")


def test_required_replies_are_arrays_of_named_calls():
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "now", "parameters": {}}])
    assert [(n, json.loads(a)) for n, a in required_calls(text)] == [("get_weather", WEATHER), ("now", {})]
    for cut in ('[{"name": "get_weather", "param', "[]x", '{"name": "a"}', "[1]"):
        assert required_calls(cut) is None


def _splits(text: str, rng: random.Random) -> list[list[str]]:
    """The reply one character a delta, in one delta, and in random pieces (as tokens would come)."""
    out = [list(text), [text]]
    for _ in range(3):
        cuts = (
            sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
            if len(text) > 1
            else []
        )
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def _assemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]] | None, set]:
    """What a client makes of the deltas: content, the calls (by index: name, arguments) and the ids."""
    content, calls, ids = None, {}, set()
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", ()):
            entry = calls.setdefault(call["index"], ["", ""])
            if "id" in call:
                assert call["type"] == "function" and call["id"] not in ids
                ids.add(call["id"])
            entry[0] += call["function"].get("name", "") or ""
            entry[1] += call["function"].get("arguments", "")
    listed = [tuple(calls[i]) for i in sorted(calls)] or None
    return content, listed, ids


STREAM_CASES = (
    [("auto", "hermes", reply) for reply, _ in HERMES_CASES]
    + [("auto", "llama3_json", reply) for reply, _ in LLAMA3_CASES]
    + [("auto", "pythonic", reply) for reply, _ in PYTHONIC_CASES]
    + [
        ("required", None, json.dumps([{"name": "get_weather", "parameters": WEATHER}])),
        ("required", None, '[{"name": "get_weather", "parameters": {"ci'),
        ("named", None, json.dumps(WEATHER, indent=2)),
        ("named", None, ""),
        ("none", None, "Plain <tool_call> text"),
    ]
)


@pytest.mark.parametrize("mode,parser,reply", STREAM_CASES)
@pytest.mark.parametrize("finish_reason", ["stop", "length"])
def test_streamed_deltas_assemble_into_the_plain_message(mode, parser, reply, finish_reason):
    replies = ToolReplies(
        mode, tool_parser(parser) if parser else None, "get_weather" if mode == "named" else None
    )
    message, expected_finish = replies.message(reply, finish_reason)
    expected_calls = [
        (c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", ())
    ]
    assert len({c["id"] for c in message.get("tool_calls", ())}) == len(expected_calls)
    if expected_calls:  # OpenAI's: a reply that ended by itself with calls the model chose: "tool_calls"
        called = "stop" if mode == "named" else "tool_calls"
        assert expected_finish == (called if finish_reason == "stop" else finish_reason)
    rng = random.Random(len(reply))
    for pieces in _splits(reply, rng):
        stream = replies.stream()
        deltas = [stream.feed(piece) for piece in pieces]
        last, finish = stream.finish(finish_reason)
        deltas.append(last)
        content, calls, _ = _assemble([d for d in deltas if d])
        assert (content or None, calls or []) == (message["content"] or None, expected_calls), pieces
        assert finish == expected_finish


def test_auto_streams_content_before_a_call_as_it_comes_and_holds_back_a_partial_marker():
    stream = ToolReplies("auto", HermesToolParser()).stream()
    assert stream.feed("Sure") == {"content": "Sure"}
    assert stream.feed(". <tool") == {"content": ". "}  # "<tool" may begin <tool_call>
    assert stream.feed("_call>\n{") == {}
    assert stream.feed('"name": "now", "arguments": {}}\n</tool_call>') == {}
    last, finish = stream.finish("stop")
    assert finish == "tool_calls" and "content" not in last
    assert [c["function"] for c in last["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    stream = ToolReplies("auto", HermesToolParser()).stream()
    assert stream.feed("a <tool") == {"content": "a "}
    assert stream.finish("length") == ({"content": "<tool"}, "length")  # never a call: the rest is content


def test_named_streams_the_arguments_as_they_come_with_the_header_first():
    stream = ToolReplies("named", function="get_weather").stream()
    assert stream.feed("") == {}
    first = stream.feed('{"city"')["tool_calls"][0]
    assert first["index"] == 0 and first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert stream.feed(': "Oslo"}') == {"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}
    assert stream.finish("stop") == ({}, "stop")
