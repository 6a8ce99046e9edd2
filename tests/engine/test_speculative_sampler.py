"""Speculative sampling is exact: tokens emitted by the verify step (kiln.engine.speculative.verify,
through the engine's Sampler filters) follow the target's filtered, tempered distribution, for a
deterministic (n-gram) proposer and for a sampled draft, and planted bugs fail the same test.

Chi-square goodness of fit over a 6-token vocabulary: the first emitted token must follow p_0, the
second (present exactly when the first proposal was accepted) p_1. Expected distributions are
computed here in float64 from the raw logits (softmax(logits / T), then top-k, then top-p over the
top-k-renormalized distribution), not by the sampler. Pass: p-value > 1e-3; the planted bugs must
give p < 1e-6 (draws use fixed seeds, so each outcome is reproducible)."""

from dataclasses import replace

import pytest
import torch

import kiln.engine.sampler as sampler_module
from kiln.engine.sampler import Sampler, SamplingError
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence
from kiln.engine.speculative.rejection_sampler import greedy_verify, rejection_sample
from kiln.engine.speculative.verify import verify_proposals
from kiln.ops.sampling.rejection_sample import cpu as rejection_sample_cpu

stats = pytest.importorskip("scipy.stats")

VOCAB = 6
DRAWS = 6000
PARAMS = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_tokens=8)
# target logits at the two proposal positions and one past them
TARGET_LOGITS = torch.tensor(
    [
        [1.0, 0.2, 2.0, -1.0, 0.5, 1.5],
        [0.3, 1.8, -0.5, 1.2, 0.9, -2.0],
        [0.0, 0.0, 1.0, 1.0, -1.0, 0.5],
    ]
)
DRAFT_LOGITS = torch.tensor([[0.5, 0.5, 0.0, 1.5, 2.0, 0.2], [1.0, -1.0, 0.0, 2.5, 0.3, 0.3]])


def filtered_probs_float64(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: softmax(logits / T), keep the top-k, then the smallest top-p prefix, renormalize."""
    probs = (logits.double() / params.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    kept = order[: params.top_k]
    ranked = probs[kept] / probs[kept].sum()
    mass_before = ranked.cumsum(0) - ranked
    keep[kept[(mass_before < params.top_p) | (torch.arange(len(kept)) == 0)]] = True
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    support = expected_probs > 0
    if observed[~support].sum() > 0:  # a token the filters drop was drawn: no fit at all
        return 0.0
    counts = observed[support].double()
    expected = expected_probs[support] * counts.sum()
    return float(stats.chisquare(counts.numpy(), expected.numpy()).pvalue)


def emitted_tokens(
    draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, seed: int, seeded: bool = False
) -> list[list[int]]:
    """Run the engine's verify step on DRAWS sequences proposing draft_tokens[i] (int64 [DRAWS, 2]);
    seeded: each sequence has a seed of its own (seed * DRAWS + i), else they share the sampler's."""
    seqs = []
    for i in range(DRAWS):
        params = replace(PARAMS, seed=seed * DRAWS + i) if seeded else PARAMS
        seq = Sequence(f"r{i}", [3], params)
        seq.spec_token_ids = draft_tokens[i].tolist()
        seq.spec_draft_probs = None if draft_probs is None else draft_probs
        seqs.append(seq)
    sampler = Sampler(torch.device("cpu"), seed=seed)
    tokens, _ = verify_proposals(sampler, [TARGET_LOGITS] * DRAWS, seqs)
    return tokens


def first_and_second_pvalues(tokens: list[list[int]], draft_tokens: torch.Tensor) -> tuple[float, float]:
    first = torch.tensor([t[0] for t in tokens])
    second = torch.tensor([t[1] for t in tokens if len(t) > 1])  # the first proposal was accepted
    p0 = filtered_probs_float64(TARGET_LOGITS[0], PARAMS)
    p1 = filtered_probs_float64(TARGET_LOGITS[1], PARAMS)
    assert len(second) > 500  # enough accepted first proposals to test the second position
    return (
        chi_square_pvalue(torch.bincount(first, minlength=VOCAB), p0),
        chi_square_pvalue(torch.bincount(second, minlength=VOCAB), p1),
    )


def ngram_case(seed: int = 0, seeded: bool = False):
    # a deterministic proposal: tokens 2 then 3 (both inside the target's top-p set)
    draft_tokens = torch.tensor([[2, 3]]).expand(DRAWS, 2)
    tokens = emitted_tokens(draft_tokens, None, seed, seeded)
    # the first proposal is never drawn again after its rejection (the residual excludes it)
    assert all((len(t) > 1) == (t[0] == 2) for t in tokens)
    return first_and_second_pvalues(tokens, draft_tokens)


def draft_case(seed: int = 0, seeded: bool = False):
    # a sampled draft: proposals drawn from its own filtered distribution q, which goes to the verifier
    q = Sampler.probs(DRAFT_LOGITS, [PARAMS, PARAMS])
    g = torch.Generator().manual_seed(seed + 1)
    draft_tokens = torch.stack(
        [torch.multinomial(q[j], DRAWS, replacement=True, generator=g) for j in range(2)], 1
    )
    if seeded:  # as DraftProposer draws: with the noise the target's own draw at that position uses
        noise = [
            [sampler_module.seeded_exponentials(seed * DRAWS + i, j, VOCAB, "cpu") for j in range(2)]
            for i in range(DRAWS)
        ]
        draft_tokens = torch.tensor(
            [[int((q[j] / noise[i][j]).argmax()) for j in range(2)] for i in range(DRAWS)]
        )
    return first_and_second_pvalues(emitted_tokens(draft_tokens, q, seed, seeded), draft_tokens)


def test_ngram_speculation_emits_the_target_distribution_with_top_k_top_p():
    first, second = ngram_case()
    assert first > 1e-3 and second > 1e-3, (first, second)


def test_draft_speculation_emits_the_target_distribution_with_top_k_top_p():
    first, second = draft_case()
    assert first > 1e-3 and second > 1e-3, (first, second)


# The planted bugs go into kiln.ops.rejection_sample's CPU path: the implementation the engine's verify
# step dispatches to for these CPU tensors.
@pytest.mark.parametrize("case", [ngram_case, draft_case])
def test_accepting_without_the_ratio_fails_the_test(monkeypatch, case):
    monkeypatch.setattr(rejection_sample_cpu, "acceptance_probability", lambda p, q: torch.ones_like(p))
    first, _ = case()
    assert first < 1e-6


def test_resampling_from_the_target_instead_of_the_residual_fails_the_test(monkeypatch):
    monkeypatch.setattr(rejection_sample_cpu, "residual_distribution", lambda p, q: p)
    first, _ = draft_case()
    assert first < 1e-6


def test_rejection_sample_emits_accepted_prefix_then_one_token_with_ragged_proposals():
    # sequence 0 proposes 2 tokens the target surely takes, sequence 1 one it can never take
    target = torch.zeros(2, 3, 4)
    target[0, 0, 1] = target[0, 1, 2] = target[0, 2, 3] = 1.0
    target[1, 0, 0] = target[1, 1, 3] = 1.0
    drafts = torch.tensor([[1, 2], [2, 0]])
    out, accepted = rejection_sample(
        target, drafts, torch.tensor([2, 1]), None, torch.full((2, 2), 0.5), torch.ones(2, 3, 4)
    )
    assert accepted.tolist() == [2, 0]
    assert out.tolist() == [[1, 2, 3], [0, -1, -1]]


def test_greedy_verify_stops_at_the_first_mismatch_and_emits_the_argmax():
    logits = torch.tensor([[[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]] * 2)
    out, accepted = greedy_verify(logits, torch.tensor([[1, 2], [1, 0]]), torch.tensor([2, 2]))
    assert accepted.tolist() == [2, 1]
    assert out.tolist() == [[1, 2, 0], [1, 2, -1]]


def test_seeded_requests_verify_the_same_way_whatever_else_is_in_the_batch():
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8)

    def run(batch_size: int) -> list[int]:
        seqs = [Sequence(f"r{i}", [3], params if i == 0 else PARAMS) for i in range(batch_size)]
        for i, seq in enumerate(seqs):
            seq.spec_token_ids = [2, 3] if i == 0 else [4]
        logits = [TARGET_LOGITS if i == 0 else TARGET_LOGITS[:2] for i in range(batch_size)]
        return verify_proposals(Sampler(torch.device("cpu"), seed=batch_size), logits, seqs)[0][0]

    results = [run(n) for n in (1, 3, 1, 5)]
    assert results[0] == results[1] == results[2] == results[3]


# ---- seeded requests: the target's own per-position sample, whatever the proposal count ----
@pytest.mark.parametrize("case", [ngram_case, draft_case])
def test_seeded_speculation_emits_the_target_distribution(case):
    first, second = case(seeded=True)
    assert first > 1e-3 and second > 1e-3, (first, second)


def test_seeded_noise_shared_across_positions_fails_the_test(monkeypatch):
    """The test has power: one noise vector for every output position (what keying by the seed alone
    would give) correlates the second token with the first, and the second position fails."""
    monkeypatch.setattr(sampler_module, "position_seed", lambda seed, position: seed)
    _, second = ngram_case(seeded=True)
    assert second < 1e-6


def test_seeded_verify_emits_exactly_what_plain_seeded_sampling_would_for_any_proposal_count():
    """Plain seeded decoding at output positions 5, 6, 7 (row j's logits at position 5 + j) gives
    s_0, s_1, s_2. Verifying any k proposals that match s up to some point must emit s up to and
    including the first mismatch: the tokens do not depend on k, which the rest of the batch sets."""
    params = SamplingParams(temperature=1.0, seed=99, max_tokens=16)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(5))
    plain = Sequence("plain", [3, 4, 5, 6, 7, 8], params)
    plain.num_prompt_tokens = 1  # 5 output tokens so far: the next one is output position 5
    expected = []
    for j in range(3):
        expected.append(Sampler(torch.device("cpu"))(logits[j : j + 1], [plain])[0][0])
        plain.token_ids.append(expected[-1])
    for k in (1, 2):
        for right in range(k + 1):  # proposals equal expected[:right], then a wrong one
            proposal = expected[:right] + [(expected[right] + 1) % VOCAB] if right < k else expected[:k]
            seq = Sequence("spec", [3, 4, 5, 6, 7, 8], params)
            seq.num_prompt_tokens = 1
            seq.spec_token_ids = proposal[:k]
            tokens, _ = verify_proposals(Sampler(torch.device("cpu"), seed=k), [logits[: k + 1]], [seq])
            assert tokens[0] == expected[: min(right, k) + 1], (k, right)


def test_verify_fails_only_a_request_with_a_non_finite_row_before_drawing():
    logits = [TARGET_LOGITS.clone() for _ in range(3)]
    logits[1][2, 4] = float("nan")  # the bonus position of request 1
    seqs = [Sequence(f"r{i}", [3], PARAMS) for i in range(3)]
    for seq in seqs:
        seq.spec_token_ids = [2, 3]
    sampler = Sampler(torch.device("cpu"), seed=3)
    with pytest.raises(SamplingError) as info:
        verify_proposals(sampler, logits, seqs)
    assert list(info.value.failures) == ["r1"]
    healthy = [seqs[0], seqs[2]]
    retried = verify_proposals(sampler, [logits[0], logits[2]], healthy)
    assert retried == verify_proposals(Sampler(torch.device("cpu"), seed=3), [logits[0], logits[2]], healthy)


def test_verify_leaves_torch_global_generator_alone():
    seqs = [Sequence(f"r{i}", [3], p) for i, p in enumerate([replace(PARAMS, seed=1), PARAMS])]
    seqs.append(Sequence("g", [3], SamplingParams(temperature=0.0, seed=4)))
    for seq in seqs:
        seq.spec_token_ids = [2, 3]
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    verify_proposals(Sampler(torch.device("cpu")), [TARGET_LOGITS] * 3, seqs)
    assert torch.equal(torch.rand(1), expected)
