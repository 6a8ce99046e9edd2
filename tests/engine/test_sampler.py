"""Sampler: each method draws only from its support, seeds reproduce, logprobs are normalized."""

import math

import pytest
import torch

from kiln.engine.sampler import Sampler, SamplingError
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence

VOCAB = 50


def seqs_for(params_list):
    return [Sequence(f"r{i}", [3], p) for i, p in enumerate(params_list)]


def random_logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def draw(logits_row, params, draws=400, seed=0):
    """Many independent draws of one row (as a batch of identical rows)."""
    sampler = Sampler(torch.device("cpu"), seed=seed)
    logits = logits_row.expand(draws, -1).contiguous()
    tokens, _ = sampler(logits, seqs_for([params] * draws))
    return tokens


def test_greedy_rows_take_the_argmax_even_in_a_mixed_batch():
    logits = random_logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    tokens, _ = Sampler(torch.device("cpu"))(logits, seqs_for(params))
    argmax = logits.argmax(-1).tolist()
    assert [t for t, p in zip(tokens, params, strict=True) if p.greedy] == [
        a for a, p in zip(argmax, params, strict=True) if p.greedy
    ]


def test_top_k_never_samples_outside_the_top_k():
    row = random_logits(1)[0]
    tokens = draw(row, SamplingParams(temperature=1.5, top_k=3))
    allowed = set(row.topk(3).indices.tolist())
    assert set(tokens) <= allowed and len(set(tokens)) == 3


def test_top_p_samples_only_the_smallest_set_reaching_p():
    row = torch.tensor([4.0, 3.0, 2.0, 1.0] + [-2.0] * (VOCAB - 4))
    probs = row.softmax(-1)
    p = float(probs[:2].sum()) + 1e-3  # needs token 2 as well to reach p
    tokens = draw(row, SamplingParams(temperature=1.0, top_p=p))
    assert set(tokens) == {0, 1, 2}


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    row = torch.tensor([2.0, 1.9, 0.0] + [-1.0] * (VOCAB - 3))
    probs = row.softmax(-1)
    min_p = float(probs[2] / probs[0]) + 0.01  # token 2 just below the cut
    tokens = draw(row, SamplingParams(temperature=1.0, min_p=min_p))
    assert set(tokens) == {0, 1}


def test_temperature_sampling_frequencies_match_the_tempered_distribution():
    row = torch.tensor([1.0, 0.5, 0.0, -0.5] + [-30.0] * (VOCAB - 4))
    draws = 4000
    tokens = torch.tensor(draw(row, SamplingParams(temperature=0.7), draws=draws))
    freq = torch.bincount(tokens, minlength=VOCAB).double() / draws
    expected = (row.double() / 0.7).softmax(-1)
    # 4000 draws: standard error <= 0.008 per token; 0.035 is > 4 sigma
    assert (freq - expected).abs().max() < 0.035


def test_same_seed_gives_same_tokens_whatever_the_batch_composition():
    logits = random_logits(8, seed=1)
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)
    seq = seqs_for([seeded])[0]
    sampler = Sampler(torch.device("cpu"), seed=5)
    alone = []
    for _ in range(5):
        alone.append(sampler(logits[3:4], [seq])[0][0])
    others = [SamplingParams(temperature=1.0)] * 7
    seq2 = seqs_for([seeded])[0]
    sampler2 = Sampler(torch.device("cpu"), seed=99)
    in_batch = []
    for _ in range(5):
        batch = seqs_for(others)
        batch.insert(3, seq2)
        in_batch.append(sampler2(logits, batch)[0][3])
    assert alone == in_batch
    assert len(set(alone)) > 1  # the draws do vary step to step


def test_logprobs_are_normalized_sorted_and_include_the_chosen_token():
    logits = random_logits(3, seed=2)
    params = [
        SamplingParams(temperature=1.0, logprobs=4),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    tokens, logprobs = Sampler(torch.device("cpu"), seed=3)(logits, seqs_for(params))
    ref = logits.double().log_softmax(-1)
    assert logprobs[2] is None
    assert list(logprobs[1]) == [tokens[1]]
    top4 = ref[0].topk(4).indices.tolist()
    assert set(top4) <= set(logprobs[0]) and tokens[0] in logprobs[0]
    for row, entry in enumerate(logprobs[:2]):
        for token_id, lp in entry.items():
            assert lp == pytest.approx(float(ref[row, token_id]), abs=1e-5)
    assert math.isclose(float(ref[0].exp().sum()), 1.0, rel_tol=1e-9)


def test_seeded_unfiltered_request_draws_the_same_tokens_next_to_filtered_ones():
    logits = random_logits(3, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=42)
    seq_alone, seq_mixed = seqs_for([seeded, seeded])
    alone = [Sampler(torch.device("cpu"))(logits[1:2], [seq_alone])[0][0] for _ in range(6)]
    neighbours = [SamplingParams(temperature=0.8, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    mixed = []
    for _ in range(6):
        batch = seqs_for(neighbours)
        batch.insert(1, seq_mixed)
        mixed.append(Sampler(torch.device("cpu"))(logits, batch)[0][1])
    assert alone == mixed


def test_top_k_wider_than_the_vocabulary_keeps_every_token():
    row = torch.zeros(VOCAB)
    tokens = draw(row, SamplingParams(temperature=1.0, top_k=10 * VOCAB), draws=2000)
    assert len(set(tokens)) > VOCAB * 0.9


def test_temperature_near_zero_takes_the_argmax():
    """T = 1e-40 is below float32's smallest normal number: logits / T overflowed to inf and
    softmax gave NaN (then token 0). The limit T -> 0 is greedy."""
    logits = random_logits(4, seed=5)
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1e-30, top_k=5)]
    params += [SamplingParams(temperature=1e-40, top_p=0.9, seed=7), SamplingParams(temperature=1e-6)]
    tokens, _ = Sampler(torch.device("cpu"), seed=1)(logits, seqs_for(params))
    assert tokens == logits.argmax(-1).tolist()


def test_top_p_near_zero_keeps_only_the_top_token():
    """top_p = 1e-50 is 0 in float32: every token, the top one included, was dropped."""
    row = random_logits(1, seed=6)[0]
    for top_p in (1e-50, 1e-8):
        tokens = draw(row, SamplingParams(temperature=1.0, top_p=top_p), draws=50)
        assert set(tokens) == {int(row.argmax())}


def test_a_request_whose_seed_the_generator_refuses_fails_alone_and_draws_nothing():
    """seed 2**64 (past what torch.Generator takes) raised inside the batch and failed every request.
    Now the sampler names the failing request, before any generator advanced: the same batch without
    it samples exactly what it would have."""
    logits = random_logits(3, seed=8)
    good = SamplingParams(temperature=1.0, seed=11)
    bad = SamplingParams(temperature=1.0, seed=5)
    bad.seed = 2**64  # past SamplingParams' own check, as a bug elsewhere could do
    healthy, poisoned = seqs_for([good, SamplingParams(temperature=1.0)]), seqs_for([bad])[0]
    poisoned.request_id = "poisoned"
    sampler = Sampler(torch.device("cpu"), seed=2)
    with pytest.raises(SamplingError) as info:
        sampler(logits, [healthy[0], poisoned, healthy[1]])
    assert list(info.value.failures) == ["poisoned"] and "seed" in info.value.failures["poisoned"]
    retried, _ = sampler(logits[[0, 2]], healthy)
    fresh, _ = Sampler(torch.device("cpu"), seed=2)(logits[[0, 2]], seqs_for([good, SamplingParams()]))
    assert retried == fresh


def test_sampling_params_refuse_seeds_the_generator_cannot_take():
    for seed in (2**64, -(2**63) - 1, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)
    for seed in (0, -1, 2**64 - 1, -(2**63)):
        SamplingParams(seed=seed)  # the whole range torch.Generator.manual_seed takes


def test_huge_top_k_and_logprobs_past_the_vocabulary_do_not_break_the_batch():
    logits = random_logits(2, seed=9)
    params = [SamplingParams(temperature=1.0, top_k=10**30), SamplingParams(temperature=0.0, logprobs=10)]
    params[1].logprobs = VOCAB * 3  # past any check: the sampler still must not raise
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs_for(params))
    assert 0 <= tokens[0] < VOCAB and len(logprobs[1]) == VOCAB
