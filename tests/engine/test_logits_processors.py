"""Penalties, logit_bias, allowed_token_ids and min_tokens (kiln.engine.logits_processors) against
transformers' own logits processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor with
one-token sequences, MinNewTokensLengthLogitsProcessor, SuppressTokensLogitsProcessor on the tokens not
allowed) and, for the presence and frequency penalties, which transformers
lacks, OpenAI's formula in float64; on fresh random logits, batches that mix adjusted and plain rows."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.logits_processors import adjust_logits
from kiln.engine.sampler import Sampler
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence

transformers = pytest.importorskip("transformers")

VOCAB = 97
EOS = [3, 50]


def _seq(rng: torch.Generator, params: SamplingParams, prompt_len: int, output_len: int) -> Sequence:
    """A sequence whose prompt and outputs are drawn from a few ids, so that tokens repeat."""
    ids = torch.randint(0, 12, (prompt_len + output_len,), generator=rng) * 7 % VOCAB
    seq = Sequence("r", ids[:prompt_len].tolist(), params)
    seq.token_ids += ids[prompt_len:].tolist()
    stops = ([] if params.ignore_eos else EOS) + (params.stop_token_ids or [])
    seq.min_tokens_stop_ids = sorted(set(stops)) if params.min_tokens else []
    return seq


def _hf(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """transformers' processors on one row, in vLLM's order (allowed, min_tokens, bias, repetition),
    then the frequency and presence penalties by OpenAI's formula (float64)."""
    p = seq.params
    ids = torch.tensor([seq.token_ids])
    row = logits[None].clone()
    if p.allowed_token_ids is not None:
        others = sorted(set(range(VOCAB)) - set(p.allowed_token_ids))
        row = transformers.SuppressTokensLogitsProcessor(others)(ids, row)
    if p.min_tokens:
        row = transformers.MinNewTokensLengthLogitsProcessor(
            seq.num_prompt_tokens, p.min_tokens, seq.min_tokens_stop_ids
        )(ids, row)
    if p.logit_bias:
        bias = {(t,): b for t, b in p.logit_bias.items()}
        row = transformers.SequenceBiasLogitsProcessor(bias)(ids, row)
    if p.repetition_penalty != 1.0:
        row = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, row)
    counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.int64), minlength=VOCAB)
    row = row[0].double() - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
    return row


CASES = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7, temperature=0.0),
    SamplingParams(presence_penalty=0.8),
    SamplingParams(frequency_penalty=-1.1, presence_penalty=-0.4),
    SamplingParams(logit_bias={0: 100.0, 5: -37.5, 96: 0.25}),
    SamplingParams(min_tokens=20, max_tokens=30, stop_token_ids=[7]),
    SamplingParams(min_tokens=20, max_tokens=30, ignore_eos=True, stop_token_ids=[8, 9]),
    SamplingParams(min_tokens=3, max_tokens=30),  # output already longer: nothing banned
    SamplingParams(
        repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=1.5, logit_bias={7: 3.0, 3: -2.0},
        min_tokens=16, max_tokens=16,
    ),
    SamplingParams(temperature=0.5, top_k=5),
    SamplingParams(allowed_token_ids=[3, 7, 14, 90, 7]),
    SamplingParams(allowed_token_ids=[3, 7, 50, 96], min_tokens=30, max_tokens=30, repetition_penalty=2.0),
]  # fmt: skip


@pytest.mark.parametrize("seed", range(3))
def test_each_row_matches_transformers_processors_and_openais_formula(seed):
    rng = torch.Generator().manual_seed(seed)
    seqs = [_seq(rng, p, prompt_len=5 + 3 * i, output_len=i + seed) for i, p in enumerate(CASES)]
    logits = torch.randn(len(seqs), VOCAB, generator=rng) * 4
    out = adjust_logits(logits.clone(), seqs)
    assert out.dtype == torch.float32 and out.shape == logits.shape
    for i, seq in enumerate(seqs):
        ref = _hf(logits[i], seq)
        if not seq.params.adjusts_logits:
            assert torch.equal(out[i], logits[i]), i  # plain rows bit for bit
            continue
        assert not torch.equal(out[i], logits[i]) or seq.params.min_tokens <= seq.num_output_tokens, i
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(out[i]), finite), i  # the banned tokens, and only they
        assert (out[i][~finite] == float("-inf")).all() and not out[i].isnan().any()
        error = (out[i][finite].double() - ref[finite]).norm() / ref[finite].norm()
        assert error < 1e-6, (i, error.item())  # float32 arithmetic against float64


def test_min_tokens_bans_eos_and_stop_ids_only_until_the_output_is_long_enough():
    params = SamplingParams(min_tokens=4, max_tokens=8, stop_token_ids=[11])
    rng = torch.Generator().manual_seed(5)
    logits = torch.randn(1, VOCAB, generator=rng)
    for outputs, banned in ((0, True), (3, True), (4, False), (6, False)):
        seq = _seq(rng, params, prompt_len=4, output_len=outputs)
        out = adjust_logits(logits, [seq])
        assert (out[0, [3, 11, 50]] == float("-inf")).all() == banned
        assert torch.isfinite(out[0]).sum() == VOCAB - 3 * banned


def test_a_batch_without_adjustments_is_returned_as_it_came():
    rng = torch.Generator().manual_seed(0)
    seqs = [_seq(rng, SamplingParams(temperature=t), 3, 2) for t in (0.0, 1.0)]
    logits = torch.randn(2, VOCAB, generator=rng).bfloat16()
    assert adjust_logits(logits, seqs) is logits


def test_non_finite_logits_stay_non_finite_and_make_no_new_nans():
    """A NaN row stays NaN (the sampler then refuses that request); -inf logits stay -inf under every
    penalty, never NaN."""
    rng = torch.Generator().manual_seed(1)
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=-2.0, frequency_penalty=2.0)
    seqs = [_seq(rng, params, 6, 6) for _ in range(2)]
    logits = torch.randn(2, VOCAB, generator=rng)
    logits[0, 3] = float("nan")
    logits[1, seqs[1].token_ids] = float("-inf")
    out = adjust_logits(logits, seqs)
    assert out[0, 3].isnan() and out[0].isnan().sum() == 1
    assert (out[1, seqs[1].token_ids] == float("-inf")).all() and not out[1].isnan().any()


def test_the_sampler_takes_the_adjusted_argmax_and_reports_the_models_logprobs():
    """Greedy rows take the argmax after the bias and penalties; logprobs stay those of the model's
    own distribution (vLLM's default), whatever the bias did."""
    rng = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=rng)
    favored = int(logits[0].argmin())
    seqs = [
        _seq(rng, SamplingParams(temperature=0.0, logit_bias={favored: 100.0}, logprobs=1), 4, 0),
        _seq(rng, SamplingParams(temperature=0.0, repetition_penalty=100.0), 4, 3),
        _seq(rng, SamplingParams(temperature=0.0, logprobs=0), 4, 3),
    ]
    # row 1: its argmax token is in its prompt, so the penalty moves the choice elsewhere
    logits[1, seqs[1].token_ids[0]] = 50.0
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs)
    assert tokens[0] == favored
    assert tokens[1] not in seqs[1].token_ids and tokens[1] == int(adjust_logits(logits, seqs)[1].argmax())
    assert tokens[2] == int(logits[2].argmax())
    model_logprobs = logits.log_softmax(dim=-1)
    assert logprobs[0][favored] == pytest.approx(model_logprobs[0, favored].item(), rel=1e-6)
    assert logprobs[2] == {tokens[2]: pytest.approx(model_logprobs[2, tokens[2]].item(), rel=1e-6)}


def test_sampling_with_penalties_draws_from_the_adjusted_distribution():
    """A sampled row with a repetition penalty: the empirical frequencies of 20000 draws (seeded
    requests, one draw per seed) match softmax of the adjusted logits (chi-square, p > 1e-4)."""
    vocab = 6
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5]])
    params = [SamplingParams(seed=s, repetition_penalty=3.0, presence_penalty=0.5) for s in range(20000)]
    seqs = []
    for p in params:
        seq = Sequence("r", [0, 1], p)
        seq.token_ids += [1]
        seqs.append(seq)
    sampler = Sampler(torch.device("cpu"))
    batch = logits.expand(len(seqs), vocab).contiguous()
    tokens, _ = sampler(batch, seqs)
    observed = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
    adjusted = logits[0].clone()
    adjusted[0] /= 3.0
    adjusted[1] = adjusted[1] / 3.0 - 0.5
    expected = adjusted.double().softmax(-1) * len(seqs)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 25.7, (observed, expected)  # 5 degrees of freedom: P(chi2 > 25.7) ~ 1e-4


def test_the_counts_kept_across_steps_equal_counts_from_scratch():
    """PenaltyHistory adds each step's new tokens to what it counted before: at every step (and after
    the output shrank) the adjusted logits equal those of a fresh sequence with the same tokens."""
    rng = torch.Generator().manual_seed(4)
    params = SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=-0.3)
    grown = _seq(rng, params, prompt_len=9, output_len=0)
    for step in range(12):
        logits = torch.randn(1, VOCAB, generator=rng)
        fresh = Sequence("f", grown.prompt_token_ids, params)
        fresh.token_ids = list(grown.token_ids)
        assert torch.equal(adjust_logits(logits, [grown]), adjust_logits(logits, [fresh])), step
        grown.token_ids += (torch.randint(0, 12, (1 + step % 3,), generator=rng) * 7 % VOCAB).tolist()
    del grown.token_ids[-5:]
    fresh = Sequence("f", grown.prompt_token_ids, params)
    fresh.token_ids = list(grown.token_ids)
    logits = torch.randn(1, VOCAB, generator=rng)
    assert torch.equal(adjust_logits(logits, [grown]), adjust_logits(logits, [fresh]))


def test_bad_words_ban_the_last_token_after_the_rest_as_transformers_no_bad_words_does():
    """transformers' NoBadWordsLogitsProcessor on the output tokens alone (vLLM matches bad words
    against the output, not the prompt): one-token words are banned always, longer ones only right
    after their other tokens."""
    rng = torch.Generator().manual_seed(6)
    words = [[14], [7, 21], [0, 7, 28], [35, 42, 49, 56], [7, 63]]
    for trial in range(40):
        seq = _seq(rng, SamplingParams(bad_words=["w"]), prompt_len=4, output_len=trial % 7)
        seq.bad_words_token_ids = words
        outputs = seq.output_token_ids
        logits = torch.randn(1, VOCAB, generator=rng)
        out = adjust_logits(logits, [seq])
        ids = torch.tensor([outputs], dtype=torch.int64) if outputs else torch.zeros(1, 0, dtype=torch.int64)
        ref = transformers.NoBadWordsLogitsProcessor(words, eos_token_id=None)(ids, logits.clone())
        assert torch.equal(out, ref), (trial, outputs)
        assert out[0, 14] == float("-inf")
