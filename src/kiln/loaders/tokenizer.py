"""Tokenizer: a `tokenizers` (Rust) tokenizer plus what the engine needs around it: special-token ids,
BOS handling and the model's chat template (rendered with jinja2, as transformers does).

Built from an HF directory (tokenizer.json + tokenizer_config.json) or from GGUF metadata
(`tokenizer.ggml.*`: a byte-level BPE from the tokens and merges, with the pre-tokenizer llama.cpp
uses for `tokenizer.ggml.pre`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

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
    ):
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

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
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        template = config.get("chat_template")
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next(
                (t["template"] for t in template if t.get("name") == "default"), template[0]["template"]
            )

        def token_id(entry: Any) -> int | None:
            text = entry.get("content") if isinstance(entry, dict) else entry
            return tok.token_to_id(text) if text else None

        bos = token_id(config.get("bos_token"))
        eos = list(eos_token_ids)
        config_eos = token_id(config.get("eos_token"))
        if config_eos is not None and config_eos not in eos:
            eos.append(config_eos)
        return cls(tok, bos_token_id=bos, eos_token_ids=eos, chat_template=template, source=path)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "") -> Tokenizer:
        """From GGUF `tokenizer.ggml.*` metadata (byte-level BPE vocabularies, "gpt2" model)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(
                f"{source}: tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        added = [
            AddedToken(tokens[i], special=types[i] == _CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (_CONTROL, _USER_DEFINED)
        ]
        tok.add_tokens(added)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [] if eos is None else [int(eos)]
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        if add_bos and bos is not None:
            bos_text = tokens[int(bos)]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos_text} $A",
                pair=f"{bos_text} $A {bos_text} $B",
                special_tokens=[(bos_text, int(bos))],
            )
        return cls(
            tok,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos_token=add_bos,
            source=source,
        )

    # ---- use ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's jinja2 template, the way
        transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
        if not self.chat_template:
            raise ValueError(
                f"apply_chat_template: the tokenizer from {self.source or 'this model'} has no chat template"
            )
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(
            value, ensure_ascii=False, indent=indent
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_ids[0] if self.eos_token_ids else None),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")
