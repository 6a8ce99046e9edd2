"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

# what torch.Generator.manual_seed takes (negative seeds are used modulo 2**64)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
PENALTY_LIMIT = 2.0  # presence and frequency penalties: OpenAI's range, [-2, 2]
LOGIT_BIAS_LIMIT = 100.0  # a logit_bias value: OpenAI's range, [-100, 100]
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What a request's output must be (vLLM's structured outputs, OpenAI's response_format): exactly
    one of

    json: a JSON schema (a dict, or its JSON text): the output is one JSON value it accepts.
    regex: a regular expression the whole output matches.
    choice: a non-empty list of non-empty strings: the output is one of them.
    grammar: an EBNF grammar (xgrammar's / GBNF syntax, start rule `root`) the output is a sentence of.
    json_object: True: the output is one JSON object, any keys (OpenAI's {"type": "json_object"}).

    disable_any_whitespace: with json / json_object, no whitespace beyond one space after ':' and ','
    (small models otherwise can fill max_tokens with newlines). Compiled by kiln.engine.structured_outputs.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_KINDS."""
        return self._given()[0]

    def _given(self) -> list[str]:
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    def validate(self) -> None:
        """Raise ValueError naming the field: exactly one constraint, each of the type it takes."""
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"StructuredOutputsParams: {name}={getattr(self, name)!r}, expected True or False"
                )
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: set exactly one of json, regex, choice, grammar, json_object; got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"StructuredOutputsParams: json is not valid JSON ({exc})") from None
            else:
                schema = self.json
            if not isinstance(schema, dict):
                raise ValueError(
                    f"StructuredOutputsParams: json={self.json!r}, expected a JSON schema (an object)"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams: {name}={value!r}, expected a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise ValueError(
                f"StructuredOutputsParams: choice={self.choice!r}, expected a non-empty list of non-empty "
                "strings"
            )


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature 0 means greedy (argmax). top_k=-1 and top_p=1.0 and min_p=0.0 switch those filters off.
    seed: the noise of the draw at output position t comes from a generator seeded with a hash of
        (seed, t), so the same seed and logits give the same tokens whatever else is batched, with or
        without speculative decoding; an integer in [-2**63, 2**64 - 1], the range torch.Generator takes.
    stop: strings that end generation (a string, or a list or tuple of them); the returned text
        stops just before the stop string (include_stop_str_in_output: just after it, as vLLM's).
    stop_token_ids: extra token ids that end generation (a list, or a tuple, of ints >= 0; like EOS,
        the token is kept in token_ids).
    logprobs: None, or the number of top alternatives to return per output token (0 = only the chosen).
    prompt_logprobs: None, or the number of top alternatives to return per prompt token (0 = only the
        prompt's own token), as vLLM's: each prompt token's logprob given the tokens before it. Such a
        request's prompt is computed, not read from the prefix cache, until its logprobs are taken.
    presence_penalty: subtracted from the logit of every token that is in the output so far (OpenAI's
        and vLLM's presence penalty), in [-2, 2]; 0 = off.
    frequency_penalty: subtracted, times the number of times it occurs in the output so far, from each
        token's logit, in [-2, 2]; 0 = off.
    repetition_penalty: for every token in the prompt or the output so far, a positive logit is divided
        by it and a negative one multiplied (the CTRL paper's penalty, as transformers' and vLLM's);
        > 0, 1 = off.
    logit_bias: {token id: bias}, each bias in [-100, 100] added to that token's logit (OpenAI's
        logit_bias); None or {} = off.
    allowed_token_ids: None, or the only token ids that may be sampled (vLLM's allowed_token_ids: every
        other logit is -inf); a non-empty list.
    bad_words: None, or words whose last token cannot be sampled right after the rest of the word's
        tokens (a one-token word: never), as vLLM's bad_words: each tokenized as it is and with a
        leading space, matched against the output so far.
    min_tokens: EOS and stop_token_ids cannot be sampled, and stop strings do not end the text, before
        this many output tokens (vLLM's min_tokens); 0 <= min_tokens <= max_tokens.
        The adjustments apply in vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias, the
        repetition, frequency and presence penalties, then temperature and the filters; greedy rows
        take the argmax of the adjusted logits. Logprobs stay those of the model's own distribution. A
        request with any of them on is not speculated (kiln.engine.logits_processors).
    structured_outputs: None, or a StructuredOutputsParams (or a dict of its fields) the output must
        follow (JSON schema, JSON object, regex, choice, grammar: kiln.engine.structured_outputs). Tokens
        the constraint rules out are masked before every other adjustment (logprobs are those of the
        masked distribution, as vLLM's); the EOS that ends the constraint ends the request even with
        ignore_eos; under speculative decoding each proposed position is masked too.
    output_kind: what each RequestOutput of the request holds, as vLLM's RequestOutputKind:
        "cumulative" (every output token, the text and logprobs so far), "delta" (only what is new since
        the request's previous output: concatenating them gives the final output) or "final_only" (one
        output, when the request finishes). Text that could be the start of a stop string is held back
        until later tokens complete or rule out the stop string, so text never shrinks.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "cumulative"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, logit_bias, allowed_token_ids, bad_words or min_tokens changes this
        request's logits before sampling (kiln.engine.logits_processors)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.allowed_token_ids is not None
            or self.bad_words
        )

    def validate(self) -> None:
        """Raise ValueError naming the bad field and what it takes (types included: a None or a string
        where a number belongs is refused here, not met as a TypeError in the middle of a step)."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens={self.max_tokens!r}, expected an int >= 1")
        if not _is_real(self.temperature) or not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(
                f"SamplingParams: temperature={self.temperature!r}, expected a finite number >= 0 "
                "(0 = greedy)"
            )
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r}, expected -1 (off) or an int >= 1")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r}, expected a number in (0, 1] (1 = off)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams: min_p={self.min_p!r}, expected a number in [0, 1] (0 = off)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"SamplingParams: {name}={value!r}, expected None or an int >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(
                f"SamplingParams: seed={self.seed!r}, expected None or an int in [-2**63, 2**64 - 1]"
            )
        if self.stop is not None and (
            not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop)
        ):
            raise ValueError(f"SamplingParams: stop={self.stop!r}, expected a list of non-empty strings")
        if self.stop_token_ids is not None and (
            not isinstance(self.stop_token_ids, list)
            or any(not _is_int(t) or t < 0 for t in self.stop_token_ids)
        ):
            raise ValueError(
                f"SamplingParams: stop_token_ids={self.stop_token_ids!r}, expected None or a list of "
                "token ids (ints >= 0)"
            )
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams: {name}={getattr(self, name)!r}, expected True or False")
        self._validate_adjustments()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                f"SamplingParams: structured_outputs={self.structured_outputs!r}, expected None or a "
                "StructuredOutputsParams"
            )
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(
                f"SamplingParams: output_kind={self.output_kind!r}, expected one of {', '.join(OUTPUT_KINDS)}"
            )

    def _validate_adjustments(self) -> None:
        """The penalties, logit_bias, allowed_token_ids, bad_words and min_tokens (ValueError naming the
        field)."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"SamplingParams: {name}={value!r}, expected a number in [-2, 2] (0 = off)")
        rp = self.repetition_penalty
        if not _is_real(rp) or not (math.isfinite(rp) and rp > 0):
            raise ValueError(
                f"SamplingParams: repetition_penalty={rp!r}, expected a finite number > 0 (1 = off)"
            )
        bias = self.logit_bias
        if bias is not None and not isinstance(bias, dict):
            raise ValueError(f"SamplingParams: logit_bias={bias!r}, expected None or a dict token id -> bias")
        for token, value in (bias or {}).items():
            if not _is_int(token) or token < 0:
                raise ValueError(
                    f"SamplingParams: logit_bias key {token!r}, expected a token id (an int >= 0)"
                )
            if not _is_real(value) or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise ValueError(
                    f"SamplingParams: logit_bias[{token}]={value!r}, expected a number in [-100, 100]"
                )
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list) or not allowed or any(not _is_int(t) or t < 0 for t in allowed)
        ):
            raise ValueError(
                f"SamplingParams: allowed_token_ids={allowed!r}, expected None or a non-empty list of token "
                "ids (ints >= 0)"
            )
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise ValueError(
                f"SamplingParams: bad_words={self.bad_words!r}, expected None or a list of words (strings "
                "with a character other than whitespace)"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams: min_tokens={self.min_tokens!r}, expected an int in [0, max_tokens="
                f"{self.max_tokens}]"
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """An int or a float (numpy's included), not a bool: what a float field takes."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
