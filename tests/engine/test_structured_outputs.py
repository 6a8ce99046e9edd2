"""Structured outputs (kiln.engine.structured_outputs) piece by piece: the masks equal xgrammar's own
apply_token_bitmask_inplace; xgrammar's view of Kiln's tokenizers spells every token with the bytes
Kiln's detokenizer gives it; the choice grammar is exactly its choices; the sampler draws only allowed
tokens, with the masked distribution's frequencies; bad constraints are refused by name."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from kiln.engine.sampler import Sampler, SamplingError
from kiln.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.engine.sequence import Sequence
from kiln.engine.structured_outputs import StructuredOutputs, apply_grammar_masks, choice_grammar
from kiln.loaders.tokenizer import Tokenizer

xgr = pytest.importorskip("xgrammar")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small byte-level BPE (258 tokens + merges) written the way HF directories hold one."""
    from tests.models.test_llama_family_hf import _write_tokenizer

    path = tmp_path_factory.mktemp("tok")
    _write_tokenizer(path)
    return Tokenizer.from_hf_dir(str(path), eos_token_ids=[1])


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputs(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


class _Row:
    """What apply_grammar_masks reads of a Sequence."""

    def __init__(self, grammar, output=(), request_id="r"):
        self.grammar, self.output_token_ids, self.request_id = grammar, list(output), request_id


@pytest.mark.parametrize("vocab", [100, 4096, 49157])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_equal_xgrammars_own_kernel_on_random_bitmasks(vocab, dtype):
    rng = np.random.default_rng(vocab)
    words = -(-vocab // 32)

    class _Fixed:  # a "grammar" whose mask is a given random bitmask
        def __init__(self, mask):
            self.mask = mask

        def catch_up(self, seq):
            return None

        def fill(self, bitmask, row):
            bitmask[row] = self.mask

    masks = rng.integers(-(2**31), 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    rows = [_Row(_Fixed(masks[0])), _Row(None), _Row(_Fixed(masks[1])), _Row(_Fixed(masks[2])), _Row(None)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    out, failures = apply_grammar_masks(logits, rows)
    assert not failures and out.dtype == torch.float32 and out is not logits
    expected = logits.float().clone()
    xgr.apply_token_bitmask_inplace(expected, torch.from_numpy(masks[[0, 0, 1, 2, 2]]), indices=[0, 2, 3])
    assert torch.equal(out, expected)
    assert torch.isneginf(out[0]).any() and torch.isfinite(out[0]).any()
    assert torch.equal(out[1], logits[1].float()) and torch.equal(out[4], logits[4].float())
    # no constrained row: the logits themselves come back, untouched
    same, _ = apply_grammar_masks(logits, [_Row(None)] * len(rows))
    assert same is logits


def test_xgrammar_spells_each_token_with_the_bytes_kiln_gives_it(tokenizer, compiler):
    from kiln.server.serving import token_text_and_bytes

    compiler.compiler()
    info = compiler.tokenizer_info
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == tokenizer.vocab_size
    assert info.stop_token_ids == [1]
    special = {0, 1}  # <s>, </s>
    for token_id in range(tokenizer.vocab_size):
        if token_id in special:
            continue
        assert info.decoded_vocab[token_id] == token_text_and_bytes(tokenizer, token_id)[1], token_id


def test_xgrammar_reads_kilns_gguf_tokenizers_as_it_reads_transformers_own(tmp_path):
    """The embedded model's byte-level vocabulary and a SentencePiece one with byte fallback, each
    built from GGUF metadata by Kiln and by transformers: xgrammar sees the same vocabulary in both."""
    from transformers import AutoTokenizer

    pytest.importorskip("gguf")
    from kiln.loaders import default_model_path
    from kiln.loaders.gguf import open_gguf
    from tests.loaders.test_tokenizer_spm import write_spm_gguf

    write_spm_gguf(tmp_path / "phi3.gguf", "phi3")
    for path, vocab_type in (
        (default_model_path(), xgr.VocabType.BYTE_LEVEL),
        (str(tmp_path / "phi3.gguf"), xgr.VocabType.BYTE_FALLBACK),
    ):
        ours = Tokenizer.from_gguf_metadata(open_gguf(path)[1], source=path)
        theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        vocab = ours.vocab_size + 3  # a model whose head is padded past the tokenizer's vocabulary
        info = _info(StructuredOutputs(ours, vocab, ours.eos_token_ids))
        reference = xgr.TokenizerInfo.from_huggingface(
            theirs, vocab_size=vocab, stop_token_ids=ours.eos_token_ids
        )
        assert info.vocab_type == reference.vocab_type == vocab_type
        assert info.add_prefix_space == reference.add_prefix_space and info.vocab_size == vocab
        # (transformers' reading of a SentencePiece GGUF adds <s> and </s> past the file's vocabulary)
        assert info.decoded_vocab[: ours.vocab_size] == reference.decoded_vocab[: ours.vocab_size]
        assert info.decoded_vocab[ours.vocab_size :] == [b""] * 3
        assert info.stop_token_ids == ours.eos_token_ids


def _info(structured: StructuredOutputs):
    structured.compiler()
    return structured.tokenizer_info


@pytest.mark.parametrize(
    "choices", [["yes", "no"], ['say "hi"', "back\\slash", "two\nlines", "tab\tend"], ["日本", "ß", "a b"]]
)
def test_the_choice_grammar_takes_exactly_its_choices(compiler, choices):
    grammar = compiler.compile(StructuredOutputsParams(choice=choices))
    for choice in choices:
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    for other in [choices[0] + "x", choices[0][:-1], "maybe", choices[0].upper() + "!"]:
        if other in choices:
            continue
        matcher = xgr.GrammarMatcher(grammar)
        assert not (matcher.accept_string(other) and matcher.is_completed()), other
    assert choice_grammar(['a"b']) == 'root ::= "a\\"b"'


def _constrained(params, tokenizer_compiler, prompt=(5, 6), output=()):
    seq = Sequence("r", list(prompt), params)
    seq.token_ids += list(output)
    seq.grammar = tokenizer_compiler.new_state(params.structured_outputs)
    return seq


def test_greedy_rows_take_the_best_allowed_token_and_plain_rows_are_untouched(tokenizer, compiler):
    params = SamplingParams(
        temperature=0.0, logprobs=2, structured_outputs=StructuredOutputsParams(regex="[0-9]+")
    )
    digits = {tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)}
    seq = _constrained(params, compiler)
    plain = Sequence("p", [5, 6], SamplingParams(temperature=0.0))
    vocab = tokenizer.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = Sampler(torch.device("cpu"))(logits.clone(), [seq, plain])
    allowed = [t for t in range(vocab) if t in digits]
    assert tokens[0] == max(allowed, key=lambda t: logits[0, t]) and tokens[1] == int(logits[1].argmax())
    # logprobs: the masked distribution's (vLLM's), so the alternatives are allowed tokens
    expected = torch.log_softmax(logits[0, allowed].double(), 0)
    assert set(logprobs[0]) <= digits
    assert logprobs[0][tokens[0]] == pytest.approx(float(expected.max()), abs=1e-5)


def test_sampling_draws_allowed_tokens_with_the_masked_distribution(tokenizer, compiler):
    """A seeded chi-square: 8000 draws at the first position of [a-e]+ (5 allowed tokens, 4 dof; the
    bound 23.5 is exceeded with probability ~1e-4 when the frequencies are right)."""
    params = SamplingParams(
        temperature=0.7, seed=None, structured_outputs=StructuredOutputsParams(regex="[a-e]+")
    )
    letters = [tokenizer.encode(c, add_special_tokens=False)[0] for c in "abcde"]
    vocab = tokenizer.vocab_size
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(vocab, generator=gen) * 2
    state = compiler.new_state(params.structured_outputs)
    seqs = []
    for i in range(400):
        seq = Sequence(f"r{i}", [5], params)
        seq.grammar = state  # every row at the grammar's start: one matcher serves them all
        seqs.append(seq)
    sampler = Sampler(torch.device("cpu"), seed=7)
    counts = torch.zeros(vocab)
    for _ in range(20):
        tokens, _ = sampler(base.expand(len(seqs), vocab).clone(), seqs)
        counts += torch.bincount(torch.tensor(tokens), minlength=vocab)
    assert counts.sum() == 8000 and set(torch.nonzero(counts).flatten().tolist()) <= set(letters)
    p = torch.softmax(base[letters].double() / 0.7, 0)
    expected = p * 8000
    chi2 = float(((counts[letters].double() - expected) ** 2 / expected).sum())
    assert chi2 < 23.5, (chi2, counts[letters].tolist(), expected.tolist())


def test_the_matcher_follows_the_output_once_even_when_a_step_runs_again(tokenizer, compiler):
    params = SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["hello world"])
    )
    seq = _constrained(params, compiler)
    vocab = tokenizer.vocab_size
    sampler = Sampler(torch.device("cpu"))
    produced = []
    for _ in range(12):
        logits = torch.randn(1, vocab)
        # the step "fails" and runs again: the matcher must not take the tokens twice
        first, _ = sampler(logits.clone(), [seq])
        again, _ = sampler(logits.clone(), [seq])
        assert first == again
        seq.token_ids.append(first[0])
        produced.append(first[0])
        if first[0] == 1:
            break
    assert produced[-1] == 1 and tokenizer.decode(produced[:-1]) == "hello world"


def test_an_output_its_grammar_refuses_fails_that_request_alone(tokenizer, compiler):
    params = SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    bad = _constrained(params, compiler, output=tokenizer.encode("x", add_special_tokens=False))
    bad.request_id = "bad"
    good = _constrained(params, compiler)
    with pytest.raises(SamplingError) as err:
        Sampler(torch.device("cpu"))(torch.randn(2, tokenizer.vocab_size), [bad, good])
    assert set(err.value.failures) == {"bad"} and "breaks its structured_outputs grammar" in str(err.value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "expected a JSON schema"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["a", ""]}, "non-empty list"),
        ({"regex": ""}, "regex=''"),
        ({"grammar": 3}, "grammar=3"),
        ({"json_object": "yes"}, "json_object='yes'"),
    ],
)
def test_structured_outputs_params_refuse_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_take_the_constraint_as_a_dict_and_check_its_type():
    params = SamplingParams(structured_outputs={"regex": "[a-z]+"})
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.kind == "regex"
    with pytest.raises(ValueError, match="structured_outputs="):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize(
    "params, kind",
    [
        (StructuredOutputsParams(regex="(ab"), "regex"),
        (StructuredOutputsParams(grammar="root ::= missing_rule"), "grammar"),
        (StructuredOutputsParams(json={"type": "no-such-type"}), "json"),
    ],
)
def test_constraints_xgrammar_cannot_compile_are_refused_naming_the_kind(compiler, params, kind):
    with pytest.raises(ValueError, match=f"cannot compile the {kind} constraint"):
        compiler.compile(params)


def test_a_tokenizer_that_cannot_spell_text_is_refused():
    from kiln.loaders.random_weights import RandomTokenizer

    with pytest.raises(ValueError, match="need a real tokenizer"):
        StructuredOutputs(RandomTokenizer(64), 64, [1]).compile(StructuredOutputsParams(regex="a"))


def test_json_constraints_compile_from_text_or_dict_to_the_same_grammar(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for params in (StructuredOutputsParams(json=schema), StructuredOutputsParams(json=json.dumps(schema))):
        matcher = xgr.GrammarMatcher(compiler.compile(params))
        assert matcher.accept_string('{"n": 12}') and matcher.is_completed()
        matcher = xgr.GrammarMatcher(compiler.compile(params))
        assert not matcher.accept_string('{"m": 1')
    # json_object is an object (OpenAI's meaning), not any JSON value
    for compact in (False, True):
        grammar = compiler.compile(StructuredOutputsParams(json_object=True, disable_any_whitespace=compact))
        for text, ok in (('{"a": [1, 2]}', True), ("[1]", False), ("3", False), ('"s"', False)):
            matcher = xgr.GrammarMatcher(grammar)
            assert (matcher.accept_string(text) and matcher.is_completed()) == ok, (text, compact)
        matcher = xgr.GrammarMatcher(grammar)
        assert matcher.accept_string('{\n  "a": 1\n}') != compact


def test_proposal_rows_are_masked_as_the_plain_step_would_mask_each_position(tokenizer, compiler):
    """mask_proposals' row j equals apply_grammar_masks after the output and proposals 0..j-1 were
    taken one step at a time; a refused proposal leaves the rows after it as they were; the matcher
    ends where it started (the next plain step masks as before)."""
    from kiln.engine.structured_outputs import mask_proposals

    params = SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[0-9]+-[a-z]+")
    )
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    vocab = tokenizer.vocab_size
    for output, proposals, valid in (("1", "2-ab", 4), ("12", "-x!z", 2), ("", "9", 1)):
        seq = _constrained(params, compiler, output=encode(output))
        seq.spec_token_ids = encode(proposals)
        k = len(seq.spec_token_ids)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(k))
        (masked,), failures = mask_proposals([logits], [seq])
        assert not failures
        for j in range(k + 1):
            step = _constrained(params, compiler, output=encode(output) + seq.spec_token_ids[:j])
            if j <= valid:
                expected, _ = apply_grammar_masks(logits[j : j + 1], [step])
                assert torch.equal(masked[j : j + 1], expected), (output, proposals, j)
            else:
                assert torch.equal(masked[j], logits[j]), (output, proposals, j)
        again, _ = apply_grammar_masks(logits[:1], [seq])
        assert torch.equal(again, masked[:1])
