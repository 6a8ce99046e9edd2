"""`kiln serve` on the embedded SmolLM2-135M-Instruct, driven by the official `openai` client:
greedy completions and chats (streamed or not) equal `kiln.LLM` for the same prompts, n / seed /
stop / logprobs / usage behave as OpenAI's API says, and 64 concurrent clients all get right answers."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from kiln.engine import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from kiln.engine.logits_processors import bad_words_token_ids  # noqa: E402
from kiln.server.app import DEFAULT_MODEL_NAME as MODEL  # noqa: E402

KEY = "test-key"
PROMPTS = ["def add(a, b):", "The capital of France is", "Once upon a time, a small dragon"]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CHAT = [{"role": "user", "content": "Name a primary color."}]


def metric_value(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(name + " ")))


@pytest.fixture(scope="module")
def server(start_server):
    srv, _ = start_server(api_key=KEY, max_num_seqs=64)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(loaded_smollm2):
    return LLM(loaded=loaded_smollm2, device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.generate(PROMPTS, GREEDY)


def test_greedy_completions_equal_llm_generate(client, reference):
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)


def test_streamed_completion_concatenates_to_the_greedy_text(client, reference):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference[0].text
    assert len([c for c in chunks if c.choices]) > 1  # streamed in pieces, not one block
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reference[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(reference[0].token_ids)


def test_greedy_chat_equals_llm_chat_streamed_and_not(client, llm):
    ref = llm.chat(CHAT, SamplingParams(max_tokens=10, temperature=0.0))[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_seeded_sampling_with_n_choices_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=6, temperature=1.0, top_p=0.95, n=2, seed=1234)
    first, second = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    # distinct per-choice seeds: two different samples (deterministic, as the seed is fixed)
    assert first.choices[0].text != first.choices[1].text
    assert 2 <= first.usage.completion_tokens <= 12


def test_stop_string_ends_the_text_just_before_it(client, llm):
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
    assert stop.strip(), f"pick a visible stop string from {ref!r}"
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == ref[: ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_ends_the_text_after_the_stop_string(client, llm):
    """vLLM's include_stop_str_in_output: the same cut, the stop string kept, streamed or not."""
    ref = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0].text
    stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    r = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ref[: ref.index(stop) + len(stop)] and r.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(**kw, stream=True, extra_body={"include_stop_str_in_output": True})
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    params = SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate(PROMPTS[0], params)[0].text == r.choices[0].text


def test_a_stop_string_across_two_tokens_streams_no_text_it_cuts(client, llm):
    """A stream holds back text that may begin a stop string: the streamed text is the non-streamed
    one, not one that also sent the stop string's first token before the next completed it."""
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0))[0]
    decode = llm.tokenizer.decode
    cut = next(  # a token boundary with a visible character on each side, met first there
        b
        for b in (len(decode(out.token_ids[:k])) for k in range(2, len(out.token_ids)))
        if 0 < b < len(out.text) and out.text[b - 1 : b + 1].strip() == out.text[b - 1 : b + 1]
        and out.text.index(out.text[b - 1 : b + 1]) == b - 1
    )  # fmt: skip
    stop = out.text[cut - 1 : cut + 1]
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    plain = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert plain == out.text[: cut - 1]
    assert streamed == plain


def test_echo_returns_the_prompt_as_sent(client):
    """Echo gave decode(encode(prompt)), which drops special-token text such as SmolLM2's
    <|im_start|> (skip_special_tokens) instead of the prompt itself."""
    prompt = "<|im_start|>user\nHi<|im_end|>\n"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert r.choices[0].text.startswith(prompt)


def test_streamed_text_offsets_are_the_plain_ones(client):
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=1)
    plain = client.completions.create(**kw).choices[0].logprobs.text_offset
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices and c.choices[0].logprobs]
    streamed = [offset for c in chunks for offset in c.choices[0].logprobs.text_offset]
    assert streamed == plain and plain[0] == 0


def test_echo_with_logprobs_scores_the_prompt_as_vllm_does(client, llm):
    """echo + logprobs (lm-eval's loglikelihood request): the logprobs cover the prompt's tokens, the
    first with null (no context), then the output's; they are the engine's prompt logprobs, the offsets
    point into the echoed text, and the stream says the same. (The server answered with the
    completion's logprobs only, as if the prompt had none, then refused the request.)"""
    prompt = PROMPTS[1]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2)
    plain = client.completions.create(**kw).choices[0]
    ref = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))[0]
    n_prompt = len(ref.prompt_token_ids)
    lp = plain.logprobs
    assert plain.text.startswith(prompt) and len(lp.tokens) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [table[t] for t, table in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:], strict=True)]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == plain.text
    assert [plain.text[o : o + len(t)] for o, t in zip(lp.text_offset, lp.tokens, strict=True)] == lp.tokens
    chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == plain.text
    streamed = [c.logprobs for c in chunks if c.logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


CJK = "月亮的诗：\n\n爱"  # SmolLM2 answers in byte-level tokens, each a part of a UTF-8 character


def test_byte_fallback_tokens_keep_their_own_logprobs_and_bytes(client, llm):
    """Tokens that are part of a character all decode alone to U+FFFD: the completions top_logprobs map
    kept one entry (the last, least likely one's logprob under the shared key) and chat's `bytes` were
    U+FFFD's. Such a token now shows as "bytes:\\xNN" in completions and "\\xNN" in chat, as OpenAI writes
    them, and its bytes are its own."""
    ref = llm.generate([CJK], SamplingParams(max_tokens=6, temperature=0.0, logprobs=5))[0]
    r = client.completions.create(model=MODEL, prompt=CJK, max_tokens=6, temperature=0, logprobs=5)
    choice = r.choices[0]
    assert choice.text == ref.text
    lp = choice.logprobs
    assert lp.tokens[0].startswith("bytes:\\x")
    rows = zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, ref.logprobs, strict=True)
    for token, chosen, top, table in rows:
        assert len(top) == 5  # five distinct alternatives, none overwritten
        assert top[token] == pytest.approx(chosen)  # greedy: the chosen token is the most likely
        assert sorted(top.values(), reverse=True) == pytest.approx(sorted(table.values(), reverse=True)[:5])
    # offsets point into the text: the three bytes of 爱 all point at it, the next token after it
    assert choice.text.startswith("爱") and lp.text_offset[:4] == [0, 0, 0, 1]
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=MODEL, prompt=CJK, max_tokens=6, temperature=0, logprobs=5, stream=True
        )
        if c.choices and c.choices[0].logprobs
    ]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CJK}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    raw = b"".join(bytes(t.bytes) for t in content)
    assert raw.decode("utf-8", errors="replace").startswith(chat.choices[0].message.content)
    assert content[0].token == "\\xe7" and content[0].bytes == [0xE7]  # OpenAI chat's form: no "bytes:"
    for t in content:
        assert all(alt.bytes != [239, 191, 189] for alt in [t, *t.top_logprobs])  # not U+FFFD's bytes


def test_stop_token_ids_end_the_choice_at_that_token(client, llm):
    """stop_token_ids was accepted and ignored: generation ran on to max_tokens."""
    ref = llm.generate(PROMPTS[1], SamplingParams(max_tokens=12, temperature=0.0))[0]
    stop_id = 30 if 30 in ref.token_ids[1:] else ref.token_ids[2]  # 30: SmolLM2's "."
    k = ref.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
    expected = llm.generate(PROMPTS[1], params)
    stop = {"stop_token_ids": [stop_id]}
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, extra_body=stop)
    r = client.completions.create(**kw)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text == expected[0].text == llm.tokenizer.decode(ref.token_ids[:k])
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        outside = {"stop_token_ids": [10**6]}
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=outside)
    assert info.value.body["param"] == "stop_token_ids"


def test_penalties_and_logit_bias_through_the_openai_client_equal_llm_generate(client, llm):
    """The OpenAI client's own presence_penalty / frequency_penalty / logit_bias arguments and vLLM's
    repetition_penalty / min_tokens (extra_body) give what LLM.generate gives with the same
    SamplingParams, streamed or not, and change the greedy text of the prompt."""
    prompt = "List the days of the week: Monday, Tuesday,"
    plain = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0]
    banned = plain.token_ids[0]
    fields = dict(presence_penalty=0.6, frequency_penalty=0.9, repetition_penalty=1.3, min_tokens=16)
    params = SamplingParams(max_tokens=16, temperature=0.0, logit_bias={banned: -100.0}, **fields)
    expected = llm.generate(prompt, params)[0]
    assert expected.text != plain.text and banned not in expected.token_ids
    kw = dict(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=0.6, frequency_penalty=0.9,
        logit_bias={str(banned): -100}, extra_body={"repetition_penalty": 1.3, "min_tokens": 16},
    )  # fmt: skip
    r = client.completions.create(**kw)
    assert r.choices[0].text == expected.text and r.usage.completion_tokens == 16
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, logit_bias={"49152": 1})
    assert info.value.body["param"] == "logit_bias"


def test_bad_words_take_vllms_spaced_forms_and_keep_the_word_out_of_the_text(client, llm):
    """SmolLM2's byte-level BPE: a word's spaced form is added when it is one more word token of the
    same length ("hello" / " hello"), not when the space changes the split ("kiln" is 2 tokens, " kiln"
    1). Through the server (vLLM's bad_words field), the greedy text loses the word and equals
    LLM.generate with the same SamplingParams."""
    tokenizer = llm.tokenizer
    ids = bad_words_token_ids(tokenizer, ["hello", "  world", "Paris is", "kiln"], 49152)
    assert ids == [[28120], [33662], [6693], [905], [38634, 314], [7042, 314], [31385, 94]]
    assert tokenizer.encode(" kiln", add_special_tokens=False) == [34813]
    prompt = PROMPTS[1]
    plain = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))[0].text
    word = plain.split()[0]  # "Paris"
    params = SamplingParams(max_tokens=12, temperature=0.0, bad_words=[word])
    expected = llm.generate(prompt, params)[0].text
    assert word not in expected and expected != plain
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"bad_words": [word]}
    )
    assert r.choices[0].text == expected


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PERSON_CHAT = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}]


def test_response_format_json_schema_through_the_openai_client_equals_llm_chat(client, llm):
    """OpenAI's response_format json_schema (and the client's own `parse` with a pydantic model, which
    sends one with strict: true): the greedy reply equals LLM.chat with the same schema, streamed or not,
    and parses into the model."""
    pydantic = pytest.importorskip("pydantic")
    jsonschema = pytest.importorskip("jsonschema")
    constraint = StructuredOutputsParams(json=PERSON_SCHEMA)
    expected = llm.chat(
        PERSON_CHAT, SamplingParams(max_tokens=64, temperature=0.0, structured_outputs=constraint)
    )
    expected = expected[0]
    assert expected.finish_reason == "stop"
    jsonschema.validate(json.loads(expected.text), PERSON_SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    kw = dict(model=MODEL, messages=PERSON_CHAT, max_tokens=64, temperature=0, response_format=fmt)
    r = client.chat.completions.create(**kw)
    assert r.choices[0].message.content == expected.text and r.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text

    class Person(pydantic.BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(
        model=MODEL, messages=PERSON_CHAT, max_tokens=64, temperature=0, response_format=Person
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.name == "Ann" and person.age == 31


def test_vllm_structured_outputs_and_guided_fields_constrain_completions_and_chats(client, llm):
    """vLLM's structured_outputs (choice, regex, json_object) and guided_regex, sampled with n = 3:
    every choice is what the constraint allows; greedy equals LLM.generate with the same constraint."""
    prompt = "The capital of France is"
    for extra, constraint, valid in (
        ({"structured_outputs": {"choice": ["Paris", "Rome"]}}, {"choice": ["Paris", "Rome"]},
         lambda t: t in ("Paris", "Rome")),
        ({"guided_regex": " [A-Z][a-z]+\\."}, {"regex": " [A-Z][a-z]+\\."},
         lambda t: re.fullmatch(" [A-Z][a-z]+\\.", t)),
        ({"structured_outputs": {"json_object": True}}, {"json_object": True},
         lambda t: isinstance(json.loads(t), dict)),
    ):  # fmt: skip
        params = SamplingParams(
            max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(**constraint)
        )
        expected = llm.generate(prompt, params)[0]
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=0, extra_body=extra
        )
        assert r.choices[0].text == expected.text and valid(expected.text), (extra, expected.text)
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=1.0, seed=3, n=3, extra_body=extra
        )
        assert all(valid(c.text) for c in r.choices if c.finish_reason == "stop"), [c.text for c in r.choices]
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=48, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(client):
    for extra, param in (
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= nowhere"}, "guided_grammar"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
         "response_format"),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param and "cannot compile" in info.value.body["message"]


def _stop_across_tokens(tokens: list[str], text: str) -> str:
    """Two visible characters on each side of a boundary between two tokens, met first there."""
    bounds, pos = [], 0
    for token in tokens[:-1]:
        pos += len(token)
        bounds.append(pos)
    for b in bounds:
        pair = text[b - 1 : b + 1]
        if 0 < b < len(text) and pair.strip() == pair and len(pair) == 2 and text.index(pair) == b - 1:
            return pair
    raise AssertionError(f"no stop string across a token boundary in {text!r}")


@pytest.mark.parametrize("chat", [False, True])
def test_stream_equals_the_plain_response_with_stops_across_tokens_and_several_choices(client, chat):
    """Seeded choices (n = 3) with stop strings that span token boundaries, logprobs on: per choice
    index, the streamed pieces concatenate to the non-streamed text, with the same finish reason,
    logprob tokens (and text offsets), and the usage chunk counts the same tokens."""
    if chat:
        kw = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0.8, seed=11, n=3, logprobs=True,
                  top_logprobs=1)  # fmt: skip
        create = client.chat.completions.create
    else:
        kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0.8, seed=11, n=3, logprobs=1)
        create = client.completions.create

    def tokens(choice) -> list[str]:
        return [t.token for t in choice.logprobs.content] if chat else choice.logprobs.tokens

    def text(choice) -> str:
        return choice.message.content if chat else choice.text

    free = create(**kw)
    stops = [_stop_across_tokens(tokens(c), text(c)) for c in free.choices[:2]]
    plain = create(**kw, stop=stops)
    assert [c.finish_reason for c in plain.choices[:2]] == ["stop", "stop"]
    pieces: dict[int, dict] = {}
    usage = None
    for chunk in create(**kw, stop=stops, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            mine = pieces.setdefault(c.index, {"text": "", "tokens": [], "offsets": [], "finish": None})
            mine["text"] += (c.delta.content or "") if chat else c.text
            if c.logprobs:
                mine["tokens"] += [t.token for t in c.logprobs.content] if chat else c.logprobs.tokens
                if not chat:
                    mine["offsets"] += c.logprobs.text_offset
            mine["finish"] = c.finish_reason or mine["finish"]
    assert sorted(pieces) == [c.index for c in plain.choices] == [0, 1, 2]
    for c in plain.choices:
        mine = pieces[c.index]
        assert mine["text"] == text(c) and mine["finish"] == c.finish_reason
        assert mine["tokens"] == tokens(c)
        if not chat:
            assert mine["offsets"] == c.logprobs.text_offset
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_logprobs_describe_the_chosen_greedy_tokens(client, reference):
    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == reference[0].text
    assert len(lp.token_logprobs) == len(reference[0].token_ids)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0.0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(
        len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content
    )


def test_64_concurrent_clients_all_get_the_greedy_answer(server, llm):
    prompts = [f"{i} + {i} =" for i in range(64)]  # short: 64 prompts prefill in one step
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))]

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300
        ) as c:
            tasks = [
                c.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0) for p in prompts
            ]
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [r.choices[0].text for r in results] == expected
    assert all(r.usage.completion_tokens == 2 for r in results)
    assert metric_value(server, "kiln_requests_running") == 0
    assert metric_value(server, "kiln_kv_cache_blocks_used") == 0


def test_models_lists_the_served_model_and_health_is_ok(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completions_top_logprobs_include_the_chosen_token(client):
    """OpenAI's completions logprobs list the most likely tokens "as well as the chosen tokens" (vLLM:
    up to n + 1 entries); a sampled token outside the top n was missing from its own map."""
    lp = (
        client.completions.create(
            model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=1.5, seed=5, logprobs=1
        )
        .choices[0]
        .logprobs
    )
    assert all(token in top and len(top) <= 2 for token, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the most likely
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == value
