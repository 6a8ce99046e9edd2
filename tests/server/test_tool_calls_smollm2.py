"""Named and required tool choice on the embedded SmolLM2 through the official `openai` client: the
calls' arguments are what the tools' JSON schemas allow (checked by jsonschema, not by the grammar
engine), greedy arguments equal `LLM.chat` under the same schema, streams assemble into the plain
message, the client's own `parse` with a pydantic tool reads them, and earlier calls and tool results
in the conversation are accepted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from kiln.engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kiln.server.app import DEFAULT_MODEL_NAME as MODEL  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(start_server):
    srv, _ = start_server(max_num_seqs=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    return LLM(loaded=loaded_smollm2, device="cpu", num_kv_blocks=128)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def test_named_tool_choice_gives_arguments_its_schema_allows_equal_to_llm_chat(client, llm):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and message.content is None
    [(name, arguments)] = _calls(message)
    jsonschema.validate(arguments, WEATHER)
    params = SamplingParams(
        max_tokens=64, temperature=0.0, structured_outputs=StructuredOutputsParams(json=WEATHER)
    )
    assert message.tool_calls[0].function.arguments == llm.chat(MESSAGES, params, tools=TOOLS)[0].text
    assert name == "get_weather" and message.tool_calls[0].id.startswith("chatcmpl-tool-")
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.tool_calls[0].function.arguments == message.tool_calls[0].function.arguments


def test_required_tool_choice_calls_given_tools_with_valid_arguments(client):
    kw = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=160)
    r = client.chat.completions.create(**kw, temperature=0)
    greedy = r.choices[0]
    assert greedy.finish_reason == "tool_calls" and greedy.message.content is None
    for name, arguments in _calls(greedy.message):
        jsonschema.validate(arguments, SCHEMAS[name])
    streamed = list(client.chat.completions.create(**kw, temperature=0, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].delta.tool_calls]
    assembled = [(d.function.name, json.loads(d.function.arguments)) for c in deltas for d in c.tool_calls]
    assert assembled == _calls(greedy.message)
    assert [c.choices[0].finish_reason for c in streamed if c.choices][-1] == "tool_calls"
    # sampled, and one call at most without parallel calls
    r = client.chat.completions.create(**kw, temperature=1.0, seed=7, n=4, parallel_tool_calls=False)
    finished = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert finished, [c.finish_reason for c in r.choices]
    for c in finished:
        [(name, arguments)] = _calls(c.message)
        jsonschema.validate(arguments, SCHEMAS[name])


def test_the_openai_clients_parse_reads_a_pydantic_tools_arguments(client):
    class GetWeather(pydantic.BaseModel):
        city: str
        unit: str

    tool = openai.pydantic_function_tool(GetWeather, name="get_weather")
    r = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    parsed = r.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and parsed.city


def test_a_conversation_with_earlier_calls_and_tool_results_is_answered(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0
    )
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
