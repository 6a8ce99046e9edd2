"""Structured outputs: a request's tokens constrained to a JSON schema, any JSON object, a regular
expression, a list of choices or an EBNF grammar (SamplingParams.structured_outputs), with xgrammar, the
grammar engine vLLM and SGLang use.

Per engine, on the first such request: xgrammar's view of the tokenizer (each token's bytes, the
vocabulary's kind, EOS as the stop token; ~0.6 s for a 49152-token vocabulary on a 2-core CPU) and a
compiler whose cache keeps the grammars compiled (a JSON schema: ~10 ms the first time). Per request:
a matcher, which follows the request's output tokens. At each step, before any other adjustment
(kiln.engine.logits_processors), each constrained row gets the matcher's bitmask of the tokens that may
come next, and every other token's logit becomes -inf. The bitmasks (int32 words, bit j of word w for
token 32 w + j) go to the device in one copy and are expanded by a lookup table of bytes, one gather
and one add for the whole batch, whatever the mask. xgrammar's own CPU kernel writes -inf token by
token: on a 2-core Zen 3 with SmolLM2's 49152 tokens, 16 rows took it 0.15-0.18 ms inside a JSON
string (nearly every token allowed) but 4.7 ms just after "{" (two allowed), against 0.72-1.11 ms for
the whole of apply_grammar_masks here (fill, table, copy; scripts/structured_outputs_step_cost.py).

The matcher catches up with the output at each step (the tokens appended since it last looked), so a
step that fails and runs again, or a preemption, never feeds it a token twice. A grammar ends with EOS:
the mask allows it only where the grammar may end, and it ends the request even with ignore_eos
(kiln.engine.scheduler). Speculative decoding: the verify step masks each proposed position with the
grammar's state after the proposals before it (the matcher walks them and rolls back), so the target's
distribution at every position is the constrained one and the verify rules stay exact; a proposal the
grammar refuses has probability 0 and is rejected.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import torch

from kiln.engine.host_upload import upload
from kiln.engine.sampling_params import StructuredOutputsParams

BITS = 32  # tokens per bitmask word
# compiled grammars kept (least recently used dropped beyond it): a server meets many distinct schemas
CACHE_LIMIT_BYTES = 256 << 20


class StructuredOutputs:
    """One engine's grammar compiler: `compile(params)` -> xgrammar's CompiledGrammar (cached), and
    `new_state(params)` -> a GrammarState for one request. Built lazily and thread-safe: the server
    compiles on its tokenizer threads before the engine loop adds the request (a cache hit there)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.tokenizer_info = None  # xgrammar's TokenizerInfo, with the compiler
        self._compiler = None
        self._lock = threading.Lock()

    def compiler(self):
        """xgrammar's GrammarCompiler for this tokenizer (built on first use)."""
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=2, cache_enabled=True, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
                self.tokenizer_info = info
            return self._compiler

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar of params; ValueError naming the constraint when xgrammar refuses it (a
        schema, regex or grammar it cannot parse or does not support)."""
        compiler = self.compiler()
        kind = params.kind
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                return compiler.compile_json_schema(schema, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":  # an object (xgrammar's builtin JSON grammar takes any value)
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=not params.disable_any_whitespace
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(params.grammar)
        except Exception as exc:  # xgrammar raises RuntimeError / its own errors with the parser's message
            raise ValueError(f"structured_outputs: cannot compile the {kind} constraint: {exc}") from None

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        """A matcher at the start of params' grammar, for one request."""
        return GrammarState(_xgrammar().GrammarMatcher(self.compile(params)))


class GrammarState:
    """A request's matcher and how many of its output tokens it has accepted."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.accepted = 0

    def catch_up(self, seq) -> str | None:
        """Feed the matcher the output tokens of seq (a Sequence) it has not seen; None, or why one was
        refused."""
        for token in seq.token_ids[seq.num_prompt_tokens + self.accepted :]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return f"output token {token} (number {self.accepted}) breaks its structured_outputs grammar"
            self.accepted += 1
        return None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Row `row` of bitmask (int32 [rows, words]): the tokens that may come next."""
        if self.matcher.is_terminated():  # the request ends with this step: any token will do
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_grammar_masks(logits: torch.Tensor, seqs: list) -> tuple[torch.Tensor, dict[str, str]]:
    """logits: [N, vocab], row i for seqs[i]. Returns (logits, failures): `logits` itself when no row
    is constrained, else a float32 copy where every token a constrained row's grammar rules out next is
    -inf; failures: request_id -> why, for rows whose output a grammar refused (then nothing is
    masked: the caller fails those requests and runs the step again)."""
    rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits, {}
    vocab = logits.shape[1]
    words = -(-vocab // BITS)
    failures = _catch_up([seqs[i] for i in rows])
    if failures:
        return logits, failures
    bitmask = np.full((len(rows), words), -1, dtype=np.int32)
    for j, i in enumerate(rows):
        seqs[i].grammar.fill(bitmask, j)
    at, mask_words = upload(logits.device, [np.asarray(rows, dtype=np.int64), bitmask])
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    out.index_add_(0, at, _additive(mask_words, vocab))
    return out, {}


def mask_proposals(logits: list[torch.Tensor], seqs: list) -> tuple[list[torch.Tensor], dict[str, str]]:
    """The verify step's rows (kiln.engine.speculative.verify): logits[b] [k_b + 1, vocab] for seqs[b],
    whose proposals are seqs[b].spec_token_ids. Row j of a constrained sequence is masked by its grammar
    after its output and proposals 0..j-1 (the matcher walks the proposals, then rolls back); rows past
    a proposal the grammar refuses stay as they are (that proposal is rejected: p = 0 there, so they
    are never read). Returns (float32 logits, failures) as apply_grammar_masks does."""
    constrained = [b for b, seq in enumerate(seqs) if seq.grammar is not None]
    if not constrained:
        return logits, {}
    vocab = logits[0].shape[1]
    words = -(-vocab // BITS)
    failures = _catch_up([seqs[b] for b in constrained])
    if failures:
        return logits, failures
    masks = []
    for b in constrained:
        seq, k = seqs[b], logits[b].shape[0] - 1
        bitmask = np.full((k + 1, words), -1, dtype=np.int32)
        masks.append(bitmask)
        matcher, walked = seq.grammar.matcher, 0
        for j in range(k + 1):
            seq.grammar.fill(bitmask, j)
            if j == k or matcher.is_terminated() or not matcher.accept_token(seq.spec_token_ids[j]):
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
    (mask_words,) = upload(logits[0].device, [np.concatenate(masks)])
    additive = _additive(mask_words, vocab)
    out, start = list(logits), 0
    for b in constrained:
        rows = logits[b].shape[0]
        out[b] = logits[b].float() + additive[start : start + rows]
        start += rows
    return out, {}


def _catch_up(seqs: list) -> dict[str, str]:
    """Each constrained seq's matcher takes its new output tokens; request_id -> why, for those refused."""
    failures = {}
    for seq in seqs:
        why = seq.grammar.catch_up(seq)
        if why is not None:
            failures[seq.request_id] = why
    return failures


def _additive(mask_words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 bitmask words [R, words] (on the logits' device) -> float32 [R, vocab]: 0 where a token is
    allowed, -inf where not."""
    rows, words = mask_words.shape
    expanded = _byte_masks(mask_words.device).index_select(0, mask_words.view(torch.uint8).flatten().long())
    return expanded.view(rows, words * BITS)[:, :vocab]


@functools.cache
def _byte_masks(device: torch.device) -> torch.Tensor:
    """float32 [256, 8]: row b holds 0 for the set bits of byte b and -inf for the others (the
    additive mask of 8 tokens whose bitmask byte is b; little-endian words: byte k of word w holds the
    bits of tokens 32 w + 8 k ...)."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(device)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (each a string literal: JSON's escapes are
    xgrammar's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """xgrammar's TokenizerInfo for one of Kiln's tokenizers (kiln.loaders.tokenizer.Tokenizer: its
    `tokenizers` object read through transformers' fast-tokenizer wrapper, which is what xgrammar
    inspects for the vocabulary's kind: byte-level BPE, SentencePiece byte fallback or raw).
    ValueError for a tokenizer without one (the random-weight models' stand-in)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            "structured_outputs: this model's tokenizer cannot spell text (a random-weight model's "
            "stand-in); structured outputs need a real tokenizer"
        )
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend)
    stops = [t for t in eos_token_ids if 0 <= t < vocab_size] or None
    return _xgrammar().TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab_size, stop_token_ids=stops)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "structured_outputs need xgrammar, which is not installed: pip install 'kiln[structured]' "
            "(or pip install xgrammar)"
        ) from None
    return xgrammar
