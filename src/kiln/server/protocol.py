"""OpenAI API request/response shapes for /v1/completions and /v1/chat/completions.

Requests are pydantic models with strict types: a field of the wrong type (JSON `true` for an integer,
`"2"` for a number), out of its range, or text that is not valid Unicode fails validation (-> 400 from
app.py, `param` naming the field).
Responses are plain dicts built by the helpers at the bottom (they are serialized once, straight to
JSON, which keeps the streaming path cheap). Fields of OpenAI's or vLLM's API that Kiln does not
implement (beam search, ...) are accepted only at the value that changes nothing
(OpenAI clients send some of them by default), a 400 naming them otherwise; other unknown fields are
ignored.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    Strict,
    StrictBool,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kiln.engine.sampling_params import (
    LOGIT_BIAS_LIMIT,
    PENALTY_LIMIT,
    SEED_MAX,
    SEED_MIN,
    StructuredOutputsParams,
)
from kiln.loaders.tokenizer import TEMPLATE_VARIABLES
from kiln.server.tool_protocol import (
    ChatTool,
    FunctionDefinition,
    NamedToolChoice,
    ToolCallFunction,
    ToolCallParam,
    ToolChoice,
    check_tools,
    tool_constraint,
    tool_mode,
)

MAX_STOP_STRINGS = 16  # each is searched for after every token: a long list slows the whole batch
MAX_STOP_CHARS = 512  # each; a stream holds back and rechecks up to this many characters a token
MAX_STOP_TOKEN_IDS = 256  # the engine checks every new token against the list
MAX_BAD_WORDS = 128  # each is matched against the output's tail at every token
MAX_LOGIT_BIAS = 1024  # entries: each is sent to the device and added at every step of the request
# a logprob of -inf (a token the model rules out) as OpenAI and vLLM write it: JSON has no infinity
MIN_LOGPROB = -9999.0


def _valid_text(text: str) -> str:
    """JSON allows lone surrogates ("\\ud800"), which are not Unicode text: no tokenizer takes them."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"contains a lone surrogate ({text[exc.start]!r} at character {exc.start}), not valid Unicode"
            ) from None
    return text


# Strict types: JSON true is not 1, "2" is not 2 (a float field still takes a JSON integer); Python's
# JSON reader takes NaN and Infinity, which no float field does ("Input should be a finite number").
Text = Annotated[str, AfterValidator(_valid_text)]
Float = Annotated[float, Strict(), AllowInfNan(False)]
TokenId = Annotated[StrictInt, Field(ge=0)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


# field -> (whether a value changes nothing, what to send instead). Fields of OpenAI's API and vLLM's
# extensions that this server does not implement: each is accepted at a value that changes nothing
# (or null), a 400 naming it otherwise, as answering while ignoring it would answer another request.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (lambda v: v == [], "an empty list (the deprecated functions are not read: send tools)"),
    "function_call": (lambda v: v in ("none", "auto"), '"none" or "auto" (send tool_choice)'),
    # vLLM's extensions
    "prompt_logprobs": (
        lambda v: False,
        "null (vLLM's per-choice prompt_logprobs field is not produced; completions' echo with logprobs "
        "scores the prompt)",
    ),
    "skip_special_tokens": (lambda v: v is True, "true"),
    "spaces_between_special_tokens": (lambda v: v is True, "true"),
    "truncate_prompt_tokens": (lambda v: False, "null (a prompt longer than the context is refused)"),
    "use_beam_search": (lambda v: v is False, "false"),
    "logits_processors": (lambda v: v == [], "an empty list"),
    "return_tokens_as_token_ids": (lambda v: v is False, "false"),
    "return_token_ids": (lambda v: v is False, "false"),
}
# vLLM's other guided_* fields (guided_whitespace_pattern, guided_decoding_backend, ...): the four that
# name a constraint (GUIDED_FIELDS) are read as structured_outputs
GUIDED = (lambda v: False, "null (structured outputs take their constraint only)")
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex, grammar or the choices together: compiled per request
COMPLETION_UNSUPPORTED = {
    **UNSUPPORTED,
    "tools": (lambda v: v == [], "an empty list (tools are a chat completions field)"),
    "tool_choice": (lambda v: v == "none", '"none" (tools are a chat completions field)'),
    "suffix": (lambda v: v == "", "an empty string"),
    "add_special_tokens": (lambda v: v is True, "true (a completion prompt is encoded with them)"),
    "prompt_embeds": (lambda v: False, "null"),
}
CHAT_UNSUPPORTED = {
    **UNSUPPORTED,
    "echo": (lambda v: v is False, "false"),
    "continue_final_message": (lambda v: v is False, "false"),
    "add_generation_prompt": (lambda v: v is True, "true"),
    "add_special_tokens": (lambda v: v is False, "false (the chat template writes the special tokens)"),
    "chat_template": (lambda v: False, "null (the model's own template is used)"),
    "documents": (lambda v: v == [], "an empty list"),
}


def _refuse_unsupported(data, table: dict[str, tuple[Callable[[Any], bool], str]]):
    """A 400 naming the first field of `table` (or guided_*) given at a value other than its neutral
    one; null is always neutral. Runs on the raw JSON object, before the fields are validated."""
    if not isinstance(data, dict):
        return data
    for name, value in data.items():
        guided = name.startswith("guided_") and name not in GUIDED_FIELDS
        rule = table.get(name) or (GUIDED if guided else None)
        if rule is None or value is None:
            continue
        neutral, accepted = rule
        try:
            ok = bool(neutral(value))
        except (TypeError, ValueError, AttributeError):
            ok = False
        if not ok:
            raise PydanticCustomError(
                "unsupported_field",
                "not supported by this server; leave it out or send {accepted}",
                {"param": name, "accepted": accepted},
            )
    return data


class JsonSchemaFormat(BaseModel):
    """response_format's json_schema: OpenAI's {"name", "description", "schema", "strict"} (the schema
    is always enforced, strict or not)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: {"type": "text"} (no constraint), {"type": "json_object"} or
    {"type": "json_schema", "json_schema": {...}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, grammar (EBNF), json_object."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(default=None, min_length=1)
    grammar: Text | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        for key in data if isinstance(data, dict) else ():
            if key not in known:
                raise PydanticCustomError(
                    "unsupported_field",
                    "not supported by this server; structured_outputs takes {known}",
                    {"param": f"structured_outputs.{key}", "known": ", ".join(sorted(known))},
                )
        return data


class _SamplingFields(BaseModel):
    """The sampling/stopping fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: Text
    max_tokens: StrictInt | None = None
    temperature: Float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = -1  # not in OpenAI's API; vLLM's extension: -1 or 0 (off), or >= 1
    min_p: Float = Field(default=0.0, ge=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=16)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    # vLLM's extension: token ids that end the choice (finish_reason "stop"), as EOS does
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension; benchmarks use it for fixed-length outputs
    include_stop_str_in_output: StrictBool = False  # vLLM's: the text ends after the stop string
    user: Text | None = None
    # null is the default (some clients send it); kiln.engine.logits_processors applies them
    presence_penalty: Float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    frequency_penalty: Float | None = Field(default=None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT)
    repetition_penalty: Float | None = Field(default=None, gt=0.0)  # vLLM's extension
    min_tokens: StrictInt | None = Field(default=None, ge=0)  # vLLM's extension
    # OpenAI's: token id (a JSON key, so a string of digits) -> bias in [-100, 100]
    logit_bias: dict[str, Float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's: the only tokens that may be sampled
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)
    # vLLM's: words never completed in the output (each checked against the output at every token)
    bad_words: list[Annotated[Text, Field(max_length=MAX_STOP_CHARS)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        for key, bias in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys are token ids (strings of digits), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"a bias is in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _words(cls, value):
        if any(not word.strip() for word in value or ()):
            raise ValueError("a bad word needs a character other than whitespace")
        return value

    # the output's constraint: OpenAI's response_format, vLLM's structured_outputs or its older
    # guided_json / guided_regex / guided_choice / guided_grammar (at most one of them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(default=None, min_length=1)
    guided_grammar: Text | None = None
    # (the field holding the constraint, its StructuredOutputsParams), built once by _one_constraint
    _constraint: tuple[str, StructuredOutputsParams] | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in CONSTRAINT_FIELDS if self._set(name)]
        if len(given) > 1:
            raise PydanticCustomError(
                "conflicting_constraints",
                "give one output constraint, not {given}",
                {"param": given[1], "given": " and ".join(given)},
            )
        if given:
            try:
                params = self._build_constraint()
            except ValueError as exc:
                why = {"param": given[0], "why": str(exc)}
                raise PydanticCustomError("invalid_constraint", "{why}", why) from None
            if len(json.dumps(self._constraint_value(given[0]))) > MAX_GRAMMAR_CHARS:
                raise PydanticCustomError(
                    "constraint_too_long",
                    "at most {limit} characters of JSON",
                    {"param": given[0], "limit": MAX_GRAMMAR_CHARS},
                )
            self._constraint = (given[0], params)
        return self

    def _set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and not (name == "response_format" and value.type == "text")

    def _constraint_value(self, name: str):
        value = getattr(self, name)
        return value.model_dump(by_alias=True, exclude_none=True) if isinstance(value, BaseModel) else value

    def structured_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint as SamplingParams takes it (None: no constraint)."""
        return None if self._constraint is None else self._constraint[1]

    def constraint_param(self) -> str | None:
        """The request field that holds its output constraint (what a 400 about it names)."""
        return None if self._constraint is None else self._constraint[0]

    def _build_constraint(self) -> StructuredOutputsParams:
        """The one constraint field given (response_format of a JSON type, structured_outputs or a
        guided_* field) as StructuredOutputsParams; ValueError when its fields do not make one."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt is not None and fmt.type == "json_schema":
            return StructuredOutputsParams(json=fmt.json_schema.json_schema)
        so = self.structured_outputs
        if so is not None:
            return StructuredOutputsParams(
                json=so.json_schema,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=bool(so.json_object),
                disable_any_whitespace=so.disable_any_whitespace,
            )
        name, kind = next((n, k) for n, k in GUIDED_FIELDS.items() if getattr(self, n) is not None)
        return StructuredOutputsParams(**{kind: getattr(self, name)})

    def token_biases(self) -> dict[int, float] | None:
        """logit_bias as SamplingParams takes it ({token id: bias}; None for none)."""
        return {int(key): bias for key, bias in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, value: int) -> int:
        if value < -1:
            raise ValueError("expected -1 or 0 (no top-k filter) or an integer >= 1")
        return -1 if value == 0 else value  # vLLM reads 0 as off too

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info):
        if value is not None and info.data.get("stream") is False:
            raise ValueError("stream options can only be defined when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, value):
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
        # a stream checks each new token's text against every stop string: bounded work a token
        for stop in [value] if isinstance(value, str) else value or []:
            if len(stop) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(stop)}")
        return value

    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. `prompt` is text or token ids, or a list of texts or of token-id lists
    (a batch of prompts). `logprobs`: None or the number of top alternatives per token (0..20)."""

    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    best_of: StrictInt | None = None  # generated server-side, n of them returned: only best_of == n

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        return _refuse_unsupported(data, COMPLETION_UNSUPPORTED)

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, value, info):
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise ValueError(f"best_of {value} is not supported by this server; leave it out or send n ({n})")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant message's calls (tool_call_id: extra)

    @field_validator("content")
    @classmethod
    def _text_parts_are_text(cls, value):
        # only text: a part of another type (an image, audio, a file) would be dropped, and the model
        # would answer a message other than the one sent
        if isinstance(value, list):
            for j, part in enumerate(value):
                if part.get("type") != "text":
                    raise ValueError(
                        f"part {j} has type {part.get('type')!r}: this server's models take only parts of"
                        " type 'text'"
                    )
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"part {j} of type 'text' needs a string 'text'")
                _valid_text(part["text"])
        return value

    def text(self) -> str:
        """The message's text (OpenAI's list-of-parts form, all of type "text": their texts joined with
        newlines, as vLLM joins them)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. `logprobs` is a bool; `top_logprobs` the alternatives per token
    (OpenAI's rule: only with logprobs true)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: StrictInt | None = None
    # tool calling (kiln.server.tool_protocol)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None  # null: true
    # more variables for the chat template (vLLM's; Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        return _refuse_unsupported(data, CHAT_UNSUPPORTED)

    @model_validator(mode="after")
    def _tool_choice(self):
        try:
            check_tools(self.tools, self.tool_choice)
        except ValueError as exc:
            param = "tools" if str(exc).startswith(("two tools", "at most")) else "tool_choice"
            raise PydanticCustomError("invalid_tools", "{why}", {"param": param, "why": str(exc)}) from None
        params = tool_constraint(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        if params is not None:
            if len(json.dumps(params.json)) > MAX_GRAMMAR_CHARS:
                raise PydanticCustomError(
                    "constraint_too_long",
                    "the tools' schemas: at most {limit} characters of JSON",
                    {"param": "tools", "limit": MAX_GRAMMAR_CHARS},
                )
            if self._constraint is not None:
                raise PydanticCustomError(
                    "conflicting_constraints",
                    "a named or required tool_choice constrains the reply itself; leave out {given}",
                    {"param": "tool_choice", "given": self._constraint[0]},
                )
            self._constraint = ("tool_choice", params)
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_variables(cls, value):
        taken = sorted(set(value or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"cannot set {', '.join(taken)}: the server gives the template those")
        return value

    def tool_mode(self) -> str:
        """The tool mode: "none", "auto", "required" or "named" (kiln.server.tool_protocol.tool_mode)."""
        return tool_mode(self.tools, self.tool_choice)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value


# every field name of the request models: what an error's `param` may name (pydantic's error locations
# also hold union-member tags such as "list[int]", which are not parameters)
FIELD_NAMES = frozenset(
    field.alias or name
    for model in (
        CompletionRequest,
        ChatCompletionRequest,
        ChatMessage,
        StreamOptions,
        ResponseFormat,
        JsonSchemaFormat,
        StructuredOutputsFields,
        ChatTool,
        FunctionDefinition,
        NamedToolChoice,
        ToolCallParam,
        ToolCallFunction,
    )
    for name, field in model.model_fields.items()
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finite_logprob(value: float) -> float:
    """A logprob as JSON can carry it: -inf (and anything below) is -9999.0, as OpenAI and vLLM write it
    (JSON has no infinity: the stdlib would write -Infinity, which JSON readers refuse)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN too: the comparison is false


class LogprobEntry(NamedTuple):
    """One token's logprobs. `token` is its text as a logprobs object shows it, `raw` its bytes;
    `top`: (token, raw, logprob) of the most likely alternatives, most likely first. An echoed prompt's
    first token has no context: logprob and top are None (null in the completions object)."""

    token: str
    raw: bytes
    logprob: float | None
    top: list[tuple[str, bytes, float]] | None


def completion_logprobs(entries: list[LogprobEntry], offsets: list[int]) -> dict:
    """The completions API's logprobs object; offsets[i]: where token i's text starts in the choice's
    text. A top_logprobs map keeps one entry per token text, the most likely's (two tokens can show the
    same text: special tokens, which show as ""), and the chosen token's, as OpenAI and vLLM do."""
    top_logprobs = []
    for entry in entries:
        top: dict[str, float] | None = None if entry.top is None else {}
        for token, _, logprob in entry.top or ():
            top.setdefault(token, finite_logprob(logprob))
        if top is not None:  # "as well as the chosen token" (OpenAI; vLLM: up to n + 1 entries)
            top.setdefault(entry.token, finite_logprob(entry.logprob))
        top_logprobs.append(top)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [None if e.logprob is None else finite_logprob(e.logprob) for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}; `bytes` are
    the token's own bytes (a part of a UTF-8 character's, for a byte-fallback token)."""
    return {
        "content": [
            {
                "token": chat_token(e.token, e.raw),
                "logprob": finite_logprob(e.logprob),
                "bytes": list(e.raw),
                "top_logprobs": [
                    {"token": chat_token(t, raw), "logprob": finite_logprob(v), "bytes": list(raw)}
                    for t, raw, v in e.top
                ],
            }
            for e in entries
        ]
    }


def chat_token(token: str, raw: bytes) -> str:
    """A token's text in chat logprobs: a part of a UTF-8 character shows as its bytes escaped (\\xe7),
    as OpenAI's chat API writes it, without the completions API's "bytes:" prefix (chat has `bytes`)."""
    if token.startswith("bytes:"):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return token[len("bytes:") :]
    return token


def completion_response(
    request_id: str, model: str, choices: list[dict], usage_: dict, chat: bool, created: int
) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def stream_chunk(
    request_id: str, model: str, choices: list[dict], chat: bool, created: int, usage_: dict | None = None
) -> dict:
    """One event of a stream; every chunk of a stream has the same id and `created` (its start)."""
    chunk = {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk
