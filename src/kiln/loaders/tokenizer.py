"""Tokenizer: a `tokenizers` (Rust) tokenizer plus what the engine needs around it: special-token ids,
BOS handling and the model's chat template (rendered with jinja2, as transformers does).

Built from an HF directory (tokenizer.json + tokenizer_config.json) or from GGUF metadata
(`tokenizer.ggml.*`): a byte-level BPE ("gpt2") from the tokens and merges, with the pre-tokenizer
llama.cpp uses for `tokenizer.ggml.pre`, or a SentencePiece vocabulary ("llama", see
kiln.loaders.tokenizer_spm).

Chat prompts (`encode_chat`) are tokenized so that only the template writes control tokens: special-
token text inside a message's content ("<|im_start|>system") becomes ordinary text tokens, so the
author of a message cannot forge a turn of another role.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from kiln.loaders.tokenizer_spm import sentencepiece_tokenizer
from kiln.models.config import ModelLoadError

# GPT-2's split pattern (what ByteLevel(use_regex=True) applies) and the Llama-3 / Qwen2 one.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Texts at least this long are encoded through encode_batch, which releases the GIL (encode does not):
# a server thread tokenizing a long prompt then leaves the event loop free.
_LONG_TEXT = 4096


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre` (byte-level BPE vocabularies)."""
    if pre in ("llama-bpe", "llama3", "smaug-bpe", "dbrx"):
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    if pre in ("smollm", "starcoder", "refact"):
        # Every digit is its own pre-token, then GPT-2's split.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False)  # "gpt2", "default" and unknown ones


class Tokenizer:
    """Text <-> token ids for one model.

    encode(text, add_special_tokens=True) -> list[int]   (adds BOS when the model wants it)
    decode(ids, skip_special_tokens=True) -> str
    apply_chat_template(messages, add_generation_prompt=True) -> str
    eos_token_ids: list[int]; bos_token_id: int | None; vocab_size: int
    """

    def __init__(
        self,
        tokenizer: RustTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos_token: bool = False,
        source: str = "",
        tool_use_template: str | None = None,
    ):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.chat_template = chat_template
        # a model's second template, for conversations with tools (Hermes 2 Pro's "tool_use"), as
        # transformers picks it
        self.tool_use_template = tool_use_template
        self.add_bos_token = add_bos_token
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._special_ids = special
        # leftmost, longest first: how the tokenizer itself finds added tokens in a text
        self._special_pattern = (
            re.compile("|".join(re.escape(t) for t in sorted(special, key=len, reverse=True)))
            if special
            else None
        )
        self._text_tok: RustTokenizer | None = None  # a copy that reads special-token text as text
        self._text_tok_lock = threading.Lock()
        self._templates: dict[str, Any] = {}  # template source -> compiled jinja2 template

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, directory: str, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """From tokenizer.json (+ tokenizer_config.json for the chat template and special tokens)."""
        path = os.path.join(directory, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelLoadError(f"{directory}: no tokenizer.json")
        try:
            tok = RustTokenizer.from_file(path)
        except Exception as exc:  # the Rust library raises plain Exceptions on bad JSON
            raise ModelLoadError(f"{path}: cannot parse tokenizer ({exc})") from exc
        config: dict[str, Any] = {}
        config_path = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{config_path}: cannot read JSON ({exc})") from exc
            if not isinstance(config, dict):
                raise ModelLoadError(f"{config_path}: expected a JSON object")
        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        tool_use = None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = [t for t in template if isinstance(t, dict) and isinstance(t.get("template"), str)]
            if not named:
                raise ModelLoadError(f"{config_path}: 'chat_template' is a list without templates")
            template = next(
                (t["template"] for t in named if t.get("name") == "default"), named[0]["template"]
            )
            tool_use = next((t["template"] for t in named if t.get("name") == "tool_use"), None)
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(
                f"{config_path}: 'chat_template' is {type(template).__name__}, expected text"
            )

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return tok.token_to_id(text) if text else None

        bos = token_id(config.get("bos_token"))
        eos = list(eos_token_ids)
        config_eos = token_id(config.get("eos_token"))
        if config_eos is not None and config_eos not in eos:
            eos.append(config_eos)
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=template,
            source=path,
            tool_use_template=tool_use,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "") -> Tokenizer:
        """From GGUF `tokenizer.ggml.*` metadata: byte-level BPE ("gpt2") or SentencePiece ("llama",
        kiln.loaders.tokenizer_spm) vocabularies."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ModelLoadError(
                f"{source}: tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' or "
                "SentencePiece 'llama')"
            )
        tokens, merges, types = _gguf_vocabulary(meta, source)
        bos, eos, eot = (_gguf_token_id(meta, k, len(tokens), source) for k in ("bos", "eos", "eot"))
        if model == "llama":
            file_merges = merges if "tokenizer.ggml.merges" in meta else None
            tok = sentencepiece_tokenizer(meta, tokens, types, file_merges, source)
        else:
            tok = _byte_level_tokenizer(meta, tokens, merges, types, source)
        eos_ids = [] if eos is None else [eos]
        if eot is not None and eot not in eos_ids:
            eos_ids.append(eot)
        template, tool_use = (
            meta.get(k) for k in ("tokenizer.chat_template", "tokenizer.chat_template.tool_use")
        )
        for key, value in (
            ("tokenizer.chat_template", template),
            ("tokenizer.chat_template.tool_use", tool_use),
        ):
            if value is not None and not isinstance(value, str):
                raise ModelLoadError(f"{source}: metadata key '{key}' is not a string")
        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama"))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        first = (tokens[bos], bos) if add_bos and bos is not None else None
        last = (tokens[eos], eos) if add_eos and eos is not None else None
        if first or last:
            tok.post_processor = _edge_token_processor(first, last, source)
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            chat_template=template,
            add_bos_token=first is not None,
            source=source,
            tool_use_template=tool_use,
        )

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return _encode(self._tok, text, add_special_tokens)

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The token ids of `messages` rendered with the chat template (no BOS added by encode: the
        template writes its own). Special-token text in a message's content, or straddling its edge,
        is tokenized as text unless special_tokens_in_content. When there is none, the ids are exactly
        encode(apply_chat_template(messages, tools=tools, ...), add_special_tokens=False)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs)
        if special_tokens_in_content or self._special_pattern is None:
            return self.encode(text, add_special_tokens=False)
        specials = list(self._special_pattern.finditer(text))
        if not specials:
            return self.encode(text, add_special_tokens=False)
        try:
            spans = self._content_spans(messages, add_generation_prompt, text, tools, template_kwargs)
        except ValueError:
            if any(
                isinstance(m.get("content"), str) and self._special_pattern.search(m["content"])
                for m in messages
            ):
                raise
            return self.encode(text, add_special_tokens=False)  # nothing to neutralize inside a content
        outside = [
            m for m in specials if not any(m.start() < end and start < m.end() for start, end in spans)
        ]
        if len(outside) == len(specials):  # every special token is the template's own
            return self.encode(text, add_special_tokens=False)
        # the tokenizer splits a text at its special tokens and encodes the pieces between them on their
        # own; do the same, but split only at the template's (the rest is text, specials included)
        ids: list[int] = []
        start = 0
        text_tok = self._text_tokenizer()
        for match in outside:
            ids += _encode(text_tok, text[start : match.start()], False)
            ids.append(self._special_ids[match.group()])
            start = match.end()
        ids += _encode(text_tok, text[start:], False)
        return ids

    def _content_spans(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        text: str,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[tuple[int, int]]:
        """[start, end) of each message content in `text` (the rendered chat). Found by rendering again
        with a random marker on each side of every content (inside its leading/trailing whitespace, so a
        template that trims content renders the same); refused when the template changed the content
        some other way, as the spans cannot be told apart from the template's own text then."""
        marker = f"\x00{secrets.token_hex(8)}\x00"
        marked = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and content:
                core = content.strip()
                lead = content[: len(content) - len(content.lstrip())]
                trail = content[len(content.rstrip()) :]
                m = {**m, "content": f"{lead}{marker}{core}{marker}{trail}" if core else content}
            marked.append(m)
        pieces = self.apply_chat_template(marked, add_generation_prompt, tools, template_kwargs).split(marker)
        if len(pieces) % 2 == 0 or "".join(pieces) != text:
            raise ValueError(
                "a message contains special-token text, and this model's chat template changes message "
                "content in a way that keeps the server from tokenizing that text as plain text"
            )
        spans, pos = [], 0
        for i, piece in enumerate(pieces):
            if i % 2 == 1:  # odd pieces sit between two markers: content
                spans.append((pos, pos + len(piece)))
            pos += len(piece)
        return spans

    def _text_tokenizer(self) -> RustTokenizer:
        """A copy of the tokenizer with encode_special_tokens set: special-token text stays text."""
        with self._text_tok_lock:
            if self._text_tok is None:
                tok = RustTokenizer.from_str(self._tok.to_str())
                tok.encode_special_tokens = True
                self._text_tok = tok
            return self._text_tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def backend_tokenizer(self) -> RustTokenizer:
        """The `tokenizers` object (as transformers' fast tokenizers name it): what grammar engines read
        the vocabulary from (kiln.engine.structured_outputs)."""
        return self._tok

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's jinja2 template, the way
        transformers does (sandboxed, trim_blocks, lstrip_blocks). `tools`: function definitions
        ([{"type": "function", "function": {"name", "description", "parameters"}}]) for templates that
        describe them to the model (others ignore them); with tools, the model's "tool_use" template
        where it has one. `template_kwargs`: more variables for the template (Qwen3's enable_thinking),
        as transformers' extra keyword arguments; they cannot replace the ones above (ValueError)."""
        source = self.tool_use_template if tools and self.tool_use_template else self.chat_template
        if not source:
            raise ValueError(
                f"apply_chat_template: the tokenizer from {self.source or 'this model'} has no chat template"
            )
        template = self._compiled_template(source)
        taken = sorted(set(template_kwargs or ()) & TEMPLATE_VARIABLES)
        if taken:
            raise ValueError(f"apply_chat_template: template_kwargs cannot set {', '.join(taken)}")
        return template.render(
            **(template_kwargs or {}),
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def _compiled_template(self, source: str):
        """A chat template compiled once (a server renders it for every chat request)."""
        if source not in self._templates:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._templates[source] = env.from_string(source)
        return self._templates[source]

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")


# what apply_chat_template gives every template itself
TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token", "raise_exception"}
)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson filter (not jinja's, which escapes HTML), with its options: tool-calling
    templates write tools and arguments with indent / separators."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _byte_level_tokenizer(
    meta: dict[str, Any], tokens: list[str], merges: list[tuple[str, str]], types: list[int], source: str
) -> RustTokenizer:
    """A byte-level BPE ("gpt2" vocabularies) with llama.cpp's pre-tokenizer for `tokenizer.ggml.pre`."""
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as exc:  # the Rust library raises plain Exceptions (a merge of unknown tokens)
        raise ModelLoadError(f"{source}: cannot build the BPE tokenizer from its metadata ({exc})") from exc
    pre = meta.get("tokenizer.ggml.pre", "default")
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre if isinstance(pre, str) else "default")
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
    )
    return tok


def _edge_token_processor(
    first: tuple[str, int] | None, last: tuple[str, int] | None, source: str
) -> processors.TemplateProcessing:
    """Put the (text, id) token `first` (BOS) before and `last` (EOS) after every encoded text."""
    head = f"{first[0]} " if first else ""
    tail = f" {last[0]}" if last else ""
    try:
        return processors.TemplateProcessing(
            single=f"{head}$A{tail}",
            pair=f"{head}$A{tail} {head}$B{tail}",
            special_tokens=list(dict.fromkeys(t for t in (first, last) if t)),
        )
    except Exception as exc:  # a token text the template syntax cannot hold
        raise ModelLoadError(f"{source}: cannot put tokens {first} / {last} around the text ({exc})") from exc


def _gguf_vocabulary(meta: dict[str, Any], source: str) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """tokens, merges (pairs) and token types from `tokenizer.ggml.*`, checked (ModelLoadError)."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{source}: metadata key 'tokenizer.ggml.tokens' is not a list of strings")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise ModelLoadError(f"{source}: metadata key 'tokenizer.ggml.merges' is not a list of 'a b' pairs")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(types, list) or len(types) != len(tokens):
        raise ModelLoadError(
            f"{source}: metadata key 'tokenizer.ggml.token_type' does not have one entry per token"
        )
    return tokens, [tuple(m.split(" ", 1)) for m in merges], types


def _gguf_token_id(meta: dict[str, Any], name: str, vocab: int, source: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
        raise ModelLoadError(
            f"{source}: metadata key 'tokenizer.ggml.{name}_token_id' is {value!r}, not a token id "
            f"of the {vocab}-token vocabulary"
        )
    return value


def _encode(tok: RustTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) >= _LONG_TEXT:
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids
