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
        seq.token_ids.append(alone[-1])  # the next draw is the next output position's
    others = [SamplingParams(temperature=1.0)] * 7
    seq2 = seqs_for([seeded])[0]
    sampler2 = Sampler(torch.device("cpu"), seed=99)
    in_batch = []
    for _ in range(5):
        batch = seqs_for(others)
        batch.insert(3, seq2)
        in_batch.append(sampler2(logits, batch)[0][3])
        seq2.token_ids.append(in_batch[-1])
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
    alone = []
    for _ in range(6):
        alone.append(Sampler(torch.device("cpu"))(logits[1:2], [seq_alone])[0][0])
        seq_alone.token_ids.append(alone[-1])
    neighbours = [SamplingParams(temperature=0.8, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    mixed = []
    for _ in range(6):
        batch = seqs_for(neighbours)
        batch.insert(1, seq_mixed)
        mixed.append(Sampler(torch.device("cpu"))(logits, batch)[0][1])
        seq_mixed.token_ids.append(mixed[-1])
    assert alone == mixed and len(set(alone)) > 1


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


# ---- top-k and top-p keep whole tie groups, whatever else is batched ----
stats = pytest.importorskip("scipy.stats")


def test_top_k_keeps_every_token_tied_with_the_kth_and_draws_them_uniformly():
    """40 tokens tie at the top and top_k=4: Hugging Face's TopKLogitsWarper and vLLM keep all 40
    (they drop logits below the k-th). Kiln kept the first 4 ranks of a sort, so which 4 depended on
    the other rows of the batch. Each batch composition must draw all 40 uniformly (chi-square)."""
    row = torch.zeros(VOCAB)
    row[:40] = 1.0
    params = SamplingParams(temperature=1.0, top_k=4)
    draws = 4000
    for neighbour in (None, SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=30)):
        batch = [params] * draws + ([neighbour] if neighbour else [])
        logits = torch.cat([row.expand(draws, -1), random_logits(1 if neighbour else 0, seed=3)])
        tokens = torch.tensor(Sampler(torch.device("cpu"), seed=4)(logits, seqs_for(batch))[0][:draws])
        counts = torch.bincount(tokens, minlength=VOCAB)
        assert counts[40:].sum() == 0
        assert stats.chisquare(counts[:40].numpy()).pvalue > 1e-3


def test_top_k_distribution_equals_the_reference_on_bf16_logits_full_of_ties():
    """bf16 logits tie often at the k-th value (228 of 300 rows of SmolLM2's vocabulary at top_k=50):
    the distribution is the reference's (keep logits >= the k-th), alone and next to other rows."""
    vocab, k = 49152, 50
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, vocab, generator=g) * 2.5 + 8).bfloat16().float()
    params = [SamplingParams(temperature=1.0, top_k=k), SamplingParams(temperature=0.7)]
    params += [SamplingParams(temperature=1.0, top_k=7), SamplingParams(temperature=1.0, top_k=k)]
    batched = Sampler.probs(logits, params)
    for i in (0, 3):
        kth = logits[i].double().topk(k).values[-1]
        expected = torch.where(logits[i] >= kth, logits[i].double(), float("-inf")).softmax(-1)
        assert int((logits[i] >= kth).sum()) > k  # the case: ties past the k-th
        assert torch.equal(batched[i] > 0, expected > 0)
        assert (batched[i].double() - expected).abs().max() < 1e-6
        assert torch.equal(Sampler.probs(logits[i : i + 1], [params[i]])[0], batched[i])


def test_top_p_keeps_or_drops_tied_tokens_together():
    # tokens 0-2 tie at the top (mass 0.45), tokens 3-12 tie below them
    row = torch.full((VOCAB,), float("-inf"))
    row[:3], row[3:13] = 2.0, 1.0
    for top_p, kept in ((0.3, 3), (0.44, 3), (0.46, 13), (1.0, 13)):
        probs = Sampler.probs(row[None], [SamplingParams(temperature=1.0, top_k=5, top_p=top_p)])[0]
        assert int((probs > 0).sum()) == kept, top_p


def test_top_p_one_keeps_every_token_next_to_filtered_rows():
    """top_p=1.0 is off. When another row of the batch filtered, it went through a float32 cumulative
    sum that reaches 1.0 before the end, and ~3,000 of 49,152 tokens were dropped."""
    vocab = 49152
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 3
    plain = SamplingParams(temperature=1.0)
    alone = Sampler.probs(logits[:1], [plain])[0]
    neighbours = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0, min_p=0.01)]
    batched = Sampler.probs(logits, [plain, *neighbours])[0]
    assert bool((alone > 0).all()) and torch.equal(batched, alone)


def test_top_p_just_below_one_drops_only_the_tail_the_float64_reference_drops():
    vocab = 49152
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(1)) * 3
    for top_p in (0.999999, 0.99):
        probs = Sampler.probs(row[None], [SamplingParams(temperature=1.0, top_p=top_p)])[0]
        exact = row.double().softmax(-1)
        ranked = exact.sort(descending=True).values
        num_kept = int(((ranked.cumsum(0) - ranked) < top_p).sum())
        assert int((probs > 0).sum()) == num_kept


# ---- logits that are not finite fail their request alone ----
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_inf_or_all_minus_inf_logits_fail_only_their_requests_and_draw_nothing(temperature):
    """A NaN logit gave token 0 (or the NaN's index) with NaN logprobs, +inf or an all -inf row token
    0: garbage presented as a sample. Now SamplingError names exactly those requests, before any
    draw, so the step without them samples what it would have."""
    logits = random_logits(5, seed=10)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :10] = float("-inf")  # partly -inf is fine
    params = SamplingParams(temperature=temperature, top_k=5, logprobs=2)
    seqs = seqs_for([params, SamplingParams(temperature=temperature, seed=3), params, params, params])
    sampler = Sampler(torch.device("cpu"), seed=2)
    with pytest.raises(SamplingError) as info:
        sampler(logits, seqs)
    assert sorted(info.value.failures) == ["r1", "r2", "r3"]
    assert all("not finite" in why for why in info.value.failures.values())
    healthy = [seqs[0], seqs[4]]
    retried = sampler(logits[[0, 4]], healthy)
    fresh = Sampler(torch.device("cpu"), seed=2)(logits[[0, 4]], healthy)
    assert retried == fresh and retried[0][1] >= 10


def test_a_batch_copies_its_tokens_to_the_host_once(monkeypatch):
    """On a GPU every copy to the host waits for the device: a greedy step took two (the non-finite
    check's nonzero().tolist(), then the tokens'), 0.23 ms of a 0.8 ms H200 decode step with sampling
    the largest part; a sampled step too (the check came before the draw). Tokens and finiteness now
    come back in one copy, logprobs still right."""
    logits = random_logits(4, seed=12)
    argmax = logits.argmax(-1).tolist()
    top5 = [set(row) for row in logits.topk(5).indices.tolist()]
    copies = []
    real_tolist = torch.Tensor.tolist
    real_bool, real_item = torch.Tensor.__bool__, torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append("tolist") or real_tolist(t))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: copies.append("bool") or real_bool(t))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: copies.append("item") or real_item(t))
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs_for([SamplingParams(temperature=0.0)] * 4))
    assert copies == ["tolist"]
    assert tokens == argmax and logprobs == [None] * 4
    copies.clear()
    nucleus = SamplingParams(temperature=1.0, top_k=5, top_p=0.9)  # top-p over top-k asked bool() too
    tokens, _ = Sampler(torch.device("cpu"))(logits, seqs_for([nucleus] * 4))
    assert copies == ["tolist"]
    assert all(token in top for token, top in zip(tokens, top5, strict=True))
    copies.clear()
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 4
    tokens, logprobs = Sampler(torch.device("cpu"))(logits, seqs_for(params))
    expected = logits.log_softmax(-1)
    assert [max(entry, key=entry.get) for entry in logprobs] == tokens
    assert logprobs[0][tokens[0]] == pytest.approx(expected[0, tokens[0]].item(), abs=1e-6)



def test_a_sampled_batch_sends_its_settings_to_the_device_in_one_copy(monkeypatch):
    """Temperatures, greedy flags, min-p floors, top-k, the nucleus rows and their top-p were six
    small host-to-device tensors a sampled step (and the shared noise's row index a seventh): one
    upload now (kiln.engine.host_upload), no torch.tensor from a list, the same draws."""
    import kiln.engine.sampling_rows as sampling_rows

    params = [
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, seed=7),
    ]
    logits = random_logits(4, seed=13)
    expected, _ = Sampler(torch.device("cpu"), seed=5)(logits, seqs_for(params))
    uploads, tensors = [], []
    real_upload, real_tensor = sampling_rows.upload, torch.tensor
    monkeypatch.setattr(sampling_rows, "upload", lambda *a: uploads.append(len(a[1])) or real_upload(*a))
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: tensors.append(a) or real_tensor(*a, **k))
    tokens, _ = Sampler(torch.device("cpu"), seed=5)(logits, seqs_for(params))
    monkeypatch.undo()
    assert uploads == [6] and tensors == []
    assert tokens == expected and tokens[1] == logits[1].argmax().item()

# ---- seeded draws: noise keyed by (seed, output position), nothing else ----
def test_a_seeded_greedy_row_leaves_torch_global_generator_alone():
    logits = random_logits(3, seed=11)
    params = [
        SamplingParams(temperature=0.0, seed=7),
        SamplingParams(temperature=1.0),
        SamplingParams(seed=8),
    ]
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    Sampler(torch.device("cpu"))(logits, seqs_for(params))
    assert torch.equal(torch.rand(1), expected)


def test_seeded_noise_depends_on_seed_and_position_only():
    sampler = Sampler(torch.device("cpu"), seed=0)
    seq = seqs_for([SamplingParams(seed=5)])[0]
    first = sampler.exponentials([seq, seq], [3, 4], VOCAB)
    sampler.exponentials(seqs_for([SamplingParams()] * 4), [0] * 4, VOCAB)  # other draws in between
    again = Sampler(torch.device("cpu"), seed=1).exponentials([seq], [4], VOCAB)
    assert torch.equal(first[1], again[0]) and not torch.equal(first[0], first[1])
    other_seed = sampler.exponentials(seqs_for([SamplingParams(seed=6)]), [4], VOCAB)
    assert not torch.equal(other_seed[0], first[1])


def test_seeded_draws_follow_the_distribution_across_seeds_and_across_positions():
    """The per-(seed, position) noise must still be i.i.d. Exp(1) as far as the draws can tell: many
    seeds at one position, and one seed over many positions, both sample the tempered distribution."""
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.2, 0.8] + [-30.0] * (VOCAB - 6))
    expected = (row.double() / 0.7).softmax(-1)[:6]
    draws = 3000
    sampler = Sampler(torch.device("cpu"))
    many_seeds = seqs_for([SamplingParams(temperature=0.7, seed=s) for s in range(draws)])
    across_seeds = torch.tensor(sampler(row.expand(draws, -1).contiguous(), many_seeds)[0])
    one_seed = seqs_for([SamplingParams(temperature=0.7, seed=12345)])[0]
    across_positions = []
    for _ in range(draws):
        across_positions.append(sampler(row[None], [one_seed])[0][0])
        one_seed.token_ids.append(across_positions[-1])
    for tokens in (across_seeds, torch.tensor(across_positions)):
        counts = torch.bincount(tokens, minlength=VOCAB)
        assert counts[6:].sum() == 0
        assert stats.chisquare(counts[:6].numpy(), (expected * draws).numpy()).pvalue > 1e-3
