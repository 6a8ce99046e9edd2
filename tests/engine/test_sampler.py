"""Sampler: each method draws only from its support, seeds reproduce, logprobs are normalized."""

import math

import pytest
import torch

from kiln.engine.sampler import Sampler
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
