"""Tool-call parsers for `tool_choice: "auto"`: they read the calls a model wrote in its own format out of
its reply (`kiln serve --enable-auto-tool-choice --tool-call-parser NAME`; vLLM's parser names).

- "hermes" (Hermes 2 Pro / 3, Qwen2.5 and Qwen3 chat templates): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the first `<tool_call>` is
  the message content. A last call the reply ends inside of (no `</tool_call>`) is read too.
- "llama3_json" (Llama 3.1 / 3.2 JSON tool calling): a reply that starts with `{` (after whitespace, and
  after the `<|python_tag|>` token where it is kept as text) is one or more objects
  `{"name": ..., "parameters": {...}}` separated by `;`; such a reply has no content.
- "pythonic" (Llama 3.2 / 4 pythonic templates, ToolACE): the whole reply is a Python list of calls by
  keyword, `[get_weather(city="Paris", unit="celsius"), now()]`, the values Python literals (read by
  `ast.literal_eval`, never evaluated as code); such a reply has no content.

A parser gives (content, [(name, arguments JSON text), ...]), or None when the reply calls no tool, in
which case the whole reply is content (as vLLM: a call that is not valid JSON is not a call). Streams use
`tool_section`: where the calls begin, and how much of an unfinished reply is content for sure.
"""

from __future__ import annotations

import ast
import json
import re

ToolCallTexts = list[tuple[str, str]]  # (function name, arguments as JSON text)


def _arguments_text(value) -> str:
    """A call's arguments as OpenAI's tool_calls carry them: JSON text (an object given as text stays)."""
    # allow_nan=False: JSON has no NaN or Infinity (a ValueError: not a call)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, allow_nan=False)


def _call(obj, arguments_keys: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments text) of one decoded call object; ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("a tool call is an object with a string 'name'")
    arguments = next((obj[key] for key in arguments_keys if key in obj), {})
    return obj["name"], _arguments_text(arguments)


def _marker_prefix_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (text a stream must hold back)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesToolParser:
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"
    _call_pattern = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, ToolCallTexts] | None:
        first = text.find(self.start)
        if first < 0:
            return None
        try:
            calls = [
                _call(json.loads(closed or open_), ("arguments", "parameters"))
                for closed, open_ in self._call_pattern.findall(text[first:])
            ]
        except ValueError:  # json.JSONDecodeError is one
            return None
        return (text[:first] or None), calls

    def tool_section(self, text: str) -> tuple[int | None, int]:
        """(where the calls begin, or None; how many leading characters are content for sure)."""
        first = text.find(self.start)
        if first >= 0:
            return first, first
        return None, len(text) - _marker_prefix_length(text, self.start)


class Llama3JsonToolParser:
    name = "llama3_json"
    python_tag = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, ToolCallTexts] | None:
        body = text.lstrip()
        if body.startswith(self.python_tag):
            body = body[len(self.python_tag) :].lstrip()
        if not body.startswith("{"):
            return None
        decoder, calls, pos = json.JSONDecoder(), [], 0
        try:
            while True:
                obj, pos = decoder.raw_decode(body, pos)
                calls.append(_call(obj, ("parameters", "arguments")))
                rest = body[pos:].lstrip()
                if not rest:
                    return None, calls
                if not rest.startswith(";"):
                    return None  # text after the calls: not this format's reply
                pos = len(body) - len(rest) + 1
                pos += len(body[pos:]) - len(body[pos:].lstrip())
        except ValueError:
            return None

    def tool_section(self, text: str) -> tuple[int | None, int]:
        body = text.lstrip()
        if not body:
            return None, 0  # only whitespace so far: not yet known
        if body.startswith("{") or body.startswith(self.python_tag):
            return 0, 0
        if self.python_tag.startswith(body):
            return None, 0
        return None, len(text)


class PythonicToolParser:
    name = "pythonic"

    def extract(self, text: str) -> tuple[str | None, ToolCallTexts] | None:
        body = text.strip()
        if not (body.startswith("[") and body.endswith("]")):
            return None
        try:
            tree = ast.parse(body, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = []
            for node in tree.elts:
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                    return None  # a call by keyword arguments only, of a plain name
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
                if len(arguments) != len(node.keywords):
                    return None  # **kwargs
                calls.append((node.func.id, _arguments_text(arguments)))
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
            return None
        return None, calls

    def tool_section(self, text: str) -> tuple[int | None, int]:
        body = text.lstrip()
        if not body:
            return None, 0
        return (0, 0) if body.startswith("[") else (None, len(text))


TOOL_PARSERS = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser)
}


def tool_parser(name: str):
    """The parser named `name` (ValueError naming the known ones otherwise)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool call parser {name!r} is unknown; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
