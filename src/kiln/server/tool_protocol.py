"""The request side of tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls`, assistant messages' `tool_calls` and tool messages' `tool_call_id`.

tool_choice (OpenAI's default: "auto" when tools are given, else "none"):
- "none": the tools go to the chat template (as vLLM), the reply is plain content;
- a named function ({"type": "function", "function": {"name": ...}}): the reply is constrained to that
  function's `parameters` JSON schema and returned as its one call's arguments (any model);
- "required": the reply is constrained to a JSON array of {"name", "parameters"} objects, one or more
  (at most one with parallel_tool_calls false), each naming a tool with arguments its schema allows;
- "auto": the model decides; its calls are read from the reply by the server's tool-call parser
  (kiln.server.tool_parsers), so the server must have one (`--enable-auto-tool-choice
  --tool-call-parser NAME`, as vLLM asks).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from kiln.engine.sampling_params import StructuredOutputsParams

# OpenAI's rule for function names: letters, digits, underscores and dashes, at most 64
FUNCTION_NAME = r"^[A-Za-z0-9_\-]{1,64}$"
MAX_TOOLS = 128


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr = Field(pattern=FUNCTION_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: the function takes no arguments
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    arguments: StrictStr  # JSON text, as this server and OpenAI return it


class ToolCallParam(BaseModel):
    """A call in an earlier assistant message of the conversation."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def tool_mode(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> str:
    """The tool mode of the request's fields: "none", "auto", "required" or "named" (a named function)."""
    if isinstance(tool_choice, NamedToolChoice):
        return "named"
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def check_tools(tools: list[ChatTool] | None, tool_choice: ToolChoice | None) -> None:
    """ValueError naming what is wrong: a named or required choice without tools, a name that is not
    one of the tools, two tools of one name."""
    names = [tool.function.name for tool in tools or ()]
    if len(names) > MAX_TOOLS:
        raise ValueError(f"at most {MAX_TOOLS} tools, got {len(names)}")
    doubled = sorted({name for name in names if names.count(name) > 1})
    if doubled:
        raise ValueError(f"two tools are named {doubled[0]!r}; each function needs its own name")
    mode = tool_mode(tools, tool_choice)
    if mode in ("named", "required") and not names:
        raise ValueError(f"tool_choice {_choice_text(tool_choice)} needs tools")
    if mode == "named" and tool_choice.function.name not in names:
        raise ValueError(
            f"tool_choice names function {tool_choice.function.name!r}, which is not one of the tools "
            f"({', '.join(names)})"
        )


def _choice_text(tool_choice: ToolChoice) -> str:
    return json.dumps(tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump())


def _parameters(tool: ChatTool) -> dict[str, Any]:
    # no parameters: an object (OpenAI's reading of a function without a schema)
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def tool_constraint(
    tools: list[ChatTool], tool_choice: ToolChoice, parallel_tool_calls: bool
) -> StructuredOutputsParams | None:
    """The output constraint a named or required tool_choice puts on the reply (None for none / auto):
    the named function's parameters schema, or an array of calls of the given tools."""
    mode = tool_mode(tools, tool_choice)
    if mode == "named":
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return StructuredOutputsParams(json=_parameters(tool))
    if mode != "required":
        return None
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "parameters": _parameters(tool)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def template_message(message) -> dict[str, Any]:
    """A chat message as chat templates read it: role and content text, plus an assistant message's
    tool_calls (arguments decoded from their JSON text, as Hugging Face templates and vLLM expect, a
    text that is not JSON kept as text) and a tool message's tool_call_id / name."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    extra = message.model_extra or {}
    calls = message.tool_calls
    if calls:
        out["tool_calls"] = [
            {
                **({"id": call.id} if call.id is not None else {}),
                "type": call.type,
                "function": {"name": call.function.name, "arguments": _decoded(call.function.arguments)},
            }
            for call in calls
        ]
    for key in ("tool_call_id", "name"):
        if isinstance(extra.get(key), str):
            out[key] = extra[key]
    return out


def _decoded(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def template_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates read them (the request's JSON: {"type": "function", "function": ...})."""
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]
