"""The response side of tool calling: a chat choice's reply -> its message (content and tool_calls) and
finish reason, whole (`ToolReplies.message`) or as a stream's deltas (`ToolReplies.stream`).

By tool mode (kiln.server.tool_protocol):
- "named": the reply is the arguments of one call of the named function (the constraint made it JSON
  its schema allows); streamed as they come, the first delta with the call's id, type and name.
- "required": the reply is a JSON array of {"name", "parameters"}: one call each. A stream sends the
  calls when the reply ends (a reply cut short by max_tokens is no array: it stays content).
- "auto": the server's parser (kiln.server.tool_parsers) reads the calls; content before them streams
  as it comes, text that may begin a call is held back until it is known.
The finish reason is "tool_calls" where a reply that ended by itself ("stop") called tools and the model
chose to (auto, required), as OpenAI answers; a named choice keeps "stop", as OpenAI's does.
The concatenated stream deltas equal the non-streamed message.
"""

from __future__ import annotations

import json
import uuid

from kiln.server.tool_parsers import ToolCallTexts


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _calls_json(calls: ToolCallTexts, first_index: int = 0, stream: bool = False) -> list[dict]:
    out = []
    for i, (name, arguments) in enumerate(calls):
        call = {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        out.append({"index": first_index + i, **call} if stream else call)
    return out


def required_calls(text: str) -> ToolCallTexts | None:
    """The calls of a "required" reply (a JSON array of {"name", "parameters"}), or None when the reply
    is not one (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        return None
    if not all(isinstance(i.get("name"), str) for i in items):
        return None
    return [(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items]


class ToolReplies:
    """How one request's chat choices become messages: `mode` from the request, `parser` the server's
    tool-call parser (auto mode only), `function` the named function (named mode)."""

    def __init__(self, mode: str, parser=None, function: str | None = None):
        self.mode, self.parser, self.function = mode, parser, function

    def calls(self, text: str) -> tuple[str | None, ToolCallTexts | None]:
        """(content, calls) of a whole reply; calls None: the reply called no tool."""
        if self.mode == "named":
            return None, [(self.function, text)]
        if self.mode == "required":
            calls = required_calls(text)
            return (text, None) if calls is None else (None, calls)
        if self.mode == "auto":
            found = self.parser.extract(text)
            return (text, None) if found is None else found
        return text, None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the non-streamed message, the choice's finish reason)."""
        content, calls = self.calls(text)
        message = {"role": "assistant", "content": content}
        if calls is None:
            return message, finish_reason
        message["tool_calls"] = _calls_json(calls)
        return message, _finish(self.mode, finish_reason)

    def stream(self) -> ToolStream:
        """A fresh stream state for one choice."""
        return ToolStream(self)


def _finish(mode: str, finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" and mode in ("auto", "required") else finish_reason


class ToolStream:
    """One streamed choice: `feed` each text delta, `finish` at the end; each returns the delta object to
    send ({} when nothing is due yet)."""

    def __init__(self, replies: ToolReplies):
        self.replies = replies
        self.text = ""
        self.sent = 0  # characters of text sent as content (auto), or as arguments (named)
        self.tools_found = False  # auto: a call has begun (the rest waits for the end)
        self.header_sent = False

    def feed(self, delta: str) -> dict:
        self.text += delta
        mode = self.replies.mode
        if mode == "named":
            return self._arguments()
        if mode == "auto" and not self.tools_found:
            start, safe = self.replies.parser.tool_section(self.text)
            self.tools_found = start is not None
            return self._content(safe)
        return {}  # required, or auto inside its calls: the calls go out at the end

    def finish(self, finish_reason: str | None) -> tuple[dict, str | None]:
        mode = self.replies.mode
        if mode == "named":
            return self._arguments(final=True), finish_reason
        if mode not in ("auto", "required"):
            return self._content(len(self.text)), finish_reason
        content, calls = self.replies.calls(self.text)
        if calls is None:  # no calls after all: the rest is content
            return self._content(len(self.text)), finish_reason
        delta = self._content(len(content or ""))
        delta["tool_calls"] = _calls_json(calls, stream=True)
        return delta, _finish(mode, finish_reason)

    def _content(self, upto: int) -> dict:
        piece = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return {"content": piece} if piece else {}

    def _arguments(self, final: bool = False) -> dict:
        piece = self.text[self.sent :]
        self.sent = len(self.text)
        if self.header_sent:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]} if piece else {}
        if not piece and not final:
            return {}
        self.header_sent = True
        call = {"name": self.replies.function, "arguments": piece}
        return {"tool_calls": [{"index": 0, "id": tool_call_id(), "type": "function", "function": call}]}
