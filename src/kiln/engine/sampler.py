"""Sampler: picks the next token of every sequence of a batch from its logits.

A request's structured-outputs grammar masks its row first (kiln.engine.structured_outputs), then its
penalties, biases, allowed / bad tokens and min_tokens adjust it (kiln.engine.logits_processors);
logprobs are those of the masked logits, before the adjustments (vLLM's). Greedy rows take the
argmax. Other rows: logits / temperature, then top-k, then top-p (nucleus, over the top-k-renormalized
distribution), then min-p (drop tokens below min_p * the top probability), then one draw. That is
Hugging Face's warper order; vLLM V1 applies min-p before top-k and top-p, which differs only when top_p
< 1 and min_p > 0 are both set (its nucleus is then taken over what min-p kept, so it never keeps more
than this order). The draw is an exponential race, argmax(p / E) with E ~ Exp(1) i.i.d., which samples
exactly p.

Filters keep whole tie groups: top-k keeps every token tied with the k-th largest logit (as Hugging
Face's TopKLogitsWarper and vLLM), top-p keeps or drops tokens of equal probability together, so what a
row keeps depends on its own logits only, never on the order a sort puts ties in or on the other rows
of its batch. top_p = 1 is off: the row is not filtered at all (a float32 cumulative sum reaches 1
before the last tokens and would drop them); top-p sums in float64.

Seeded requests: the noise E of the token at output position t (0 for the first output token) comes
from a generator seeded with a hash of (seed, t), made for that draw. So a seeded request's token at
position t depends only on its seed, t and its logits there: not on the batch, nor on how many
draws earlier steps took (speculative decoding verifies a varying number of positions per step, with
the same per-position noise: see kiln.engine.speculative.verify). Unseeded requests draw from the
sampler's shared generator. Greedy rows draw nothing.

Numerics: the logits are shifted by their row maximum before dividing by the temperature, and the
temperature is clamped to float32's smallest normal number, so temperature -> 0 gives the argmax
(never inf / inf = NaN); top-p always keeps the top token, so top_p -> 0 keeps just it.

Isolation: a request the sampler cannot serve (a seed outside what a generator takes; logits that
are not finite: a NaN, +inf, or every token -inf) makes it raise SamplingError naming those
requests, with nothing drawn for any row (a refused seed is seen before the draw; non-finite logits
with the tokens, in the step's one copy to the host, after which the shared generator is put back as
it was), so the caller can drop them and run the step again.
"""

from __future__ import annotations

import hashlib

import torch

from kiln.engine.argmax import row_argmax
from kiln.engine.logits_processors import adjust_logits
from kiln.engine.sampling_params import SEED_MAX, SEED_MIN, SamplingParams
from kiln.engine.sampling_rows import RowSettings
from kiln.engine.sequence import Sequence
from kiln.engine.structured_outputs import apply_grammar_masks

_TINY = torch.finfo(torch.float32).tiny
_NEG_INF = float("-inf")


class SamplingError(RuntimeError):
    """Sampling could not start for some requests of the batch.

    failures: request_id -> what went wrong. The sampler raises it with nothing drawn (a refused seed
    before the draw; non-finite logits after it, the shared generator put back), so the step can be
    run again without the failed requests. A seeded request then samples exactly what it
    would have (its noise is keyed by (seed, position)); an unseeded one may get other (equally
    distributed) draws when the failure came from the verify step of a speculative batch, after the
    batch's plain rows drew from the shared generator."""

    def __init__(self, failures: dict[str, str]):
        self.failures = dict(failures)
        super().__init__("; ".join(f"{rid}: {why}" for rid, why in self.failures.items()))


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for unseeded requests

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: float32 [N, vocab], row i for seqs[i], whose next token is its output token number
        seqs[i].num_output_tokens. Returns N token ids and, per row, the logprobs dict (top-n + chosen
        token, natural log of the model's distribution after its grammar's mask, before any penalty
        or bias) or None.
        SamplingError (nothing drawn) names the requests whose seed is refused or whose logits are not
        finite."""
        params = [s.params for s in seqs]
        failures = self.seed_failures(seqs)
        if failures:  # refused seeds: known on the host, before anything is drawn
            raise SamplingError(failures)
        logits, failures = apply_grammar_masks(logits, seqs)
        if failures:  # an output its grammar refuses (never expected): those requests fail alone
            raise SamplingError(failures)
        model_logits = logits
        logits = adjust_logits(logits, seqs)
        state = None
        if all(p.greedy for p in params):
            tokens = row_argmax(logits)
            # the argmax is the first NaN if any, +inf if any, -inf only when the whole row is
            top = logits.gather(1, tokens[:, None]).squeeze(1)
        else:
            state = self.generator.get_state()  # put back if the step fails: then nothing was drawn
            tokens = self._sample(logits, seqs)
            top = logits.amax(dim=-1)
        # tokens and finiteness reach the host in one copy: on a GPU each `.tolist()` waits for the
        # device (a sampled batch's settings went the other way in one copy too: RowSettings)
        token_list, finite = torch.stack((tokens, torch.isfinite(top).to(tokens.dtype))).tolist()
        if not all(finite):
            if state is not None:
                self.generator.set_state(state)
            raise SamplingError(non_finite_failures(top, seqs))
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if any(p.logprobs is not None for p in params):
            logprobs = self.token_logprobs(model_logits, tokens, [p.logprobs for p in params])
        return token_list, logprobs

    @staticmethod
    def seed_failures(seqs: list[Sequence]) -> dict[str, str]:
        """request_id -> why, for the seeded sampling rows whose seed a generator cannot take."""
        failures = {}
        for seq in seqs:
            seed = seq.params.seed
            if seed is None or seq.params.greedy:
                continue
            if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
                failures[seq.request_id] = (
                    f"cannot seed a generator with seed={seed!r} (expected an int in [-2**63, 2**64 - 1])"
                )
        return failures

    def check_seeds(self, seqs: list[Sequence]) -> None:
        """Check, before anything is drawn, that every seeded sampling row's seed can seed a generator
        (the per-position generators are made when drawn); SamplingError names those that cannot."""
        failures = self.seed_failures(seqs)
        if failures:
            raise SamplingError(failures)

    def exponentials(self, seqs: list[Sequence], positions: list[int], vocab: int) -> torch.Tensor:
        """The Exp(1) noise of one draw per row: float32 [len(seqs), vocab]. Row i is seqs[i]'s draw at
        output position positions[i]: from the (seed, position) generator for a seeded request, from
        the shared generator otherwise, all ones (nothing drawn) for a greedy one."""
        device = self.generator.device
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None and not s.params.greedy]
        if unseeded and len(unseeded) == len(seqs):  # every row: no index list sent to the device
            return torch.empty(len(seqs), vocab, device=device).exponential_(generator=self.generator)
        noise = torch.ones(len(seqs), vocab, device=device)
        if unseeded:
            rows = torch.empty(len(unseeded), vocab, device=device)
            noise[unseeded] = rows.exponential_(generator=self.generator)
        for i, (seq, position) in enumerate(zip(seqs, positions, strict=True)):
            if seq.params.seed is not None and not seq.params.greedy:
                noise[i] = seeded_exponentials(seq.params.seed, position, vocab, device)
        return noise

    @classmethod
    def probs(
        cls, logits: torch.Tensor, params: list[SamplingParams], settings: RowSettings | None = None
    ) -> torch.Tensor:
        """The distribution each row samples from: float32 [N, vocab], softmax of logits [N, vocab]
        divided by the row's temperature, after its top-k, top-p and min-p filters (greedy rows get
        temperature 1 and no filters; callers take their argmax instead). `settings`: params as
        device tensors (RowSettings.of), when the caller has them already."""
        if settings is None:
            settings = RowSettings.of(params, logits.shape[1], logits.device)
        # (logits - max) / T is <= 0 and finite or -inf: the top token stays at 0 however small T is
        logits = logits.float()
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        scaled = shifted / settings.temps.clamp_min(_TINY)[:, None]
        return filter_logits(scaled, settings).softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        settings = RowSettings.of(params, logits.shape[1], logits.device)
        probs = self.probs(logits, params, settings)
        # the noise is indexed by token id, never by rank or batch row, so a seeded request draws the
        # same token whatever filters the other rows of its batch use
        noise = self.exponentials(seqs, [s.num_output_tokens for s in seqs], logits.shape[1])
        choice = row_argmax(probs / noise)
        return torch.where(settings.greedy, row_argmax(logits), choice)

    @staticmethod
    def token_logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, top_ns: list[int | None]
    ) -> list[dict[int, float] | None]:
        """Per row of logits [N, vocab] (float32), for chosen tokens int64 [N]: None when top_ns[i] is
        None, else {token id: logprob} of the top top_ns[i] tokens and the chosen one (natural log of
        the unmodified distribution)."""
        logp = logits.float().log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_n = min(max(n or 0 for n in top_ns), logp.shape[1])
        top_vals, top_ids = logp.topk(max_n, dim=-1) if max_n > 0 else (None, None)
        out: list[dict[int, float] | None] = []
        token_list = tokens.tolist()
        for i, n in enumerate(top_ns):
            if n is None:
                out.append(None)
                continue
            entry: dict[int, float] = {}
            if n > 0:
                entry = dict(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True))
            entry[token_list[i]] = chosen[i]
            out.append(entry)
        return out


def prompt_token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[dict[int, float]]:
    """Per row of logits [N, vocab] (float32, at prompt positions p..p+N-1), {token id: logprob} of the
    top_n tokens and of tokens[i], the prompt token that follows (natural log, unmodified distribution)."""
    chosen = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
    return Sampler.token_logprobs(logits, chosen, [top_n] * len(tokens))


def non_finite_failures(row_max: torch.Tensor, seqs: list[Sequence]) -> dict[str, str]:
    """request_id -> why, for the rows whose maximum logit row_max [len(seqs)] is not finite: a NaN
    (max propagates it), +inf, or -inf (every token -inf). Such a row has no distribution to sample."""
    bad = torch.nonzero(~torch.isfinite(row_max)).flatten().tolist()
    return {
        seqs[i].request_id: (
            f"the model's logits are not finite (largest logit {row_max[i].item()}: a NaN, +inf, or "
            "every token -inf); no token can be sampled"
        )
        for i in bad
    }


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output position `position`: a 64-bit hash of
    (seed mod 2**64, position), so each position's noise is its own independent stream."""
    key = (seed % 2**64).to_bytes(8, "little") + position.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def seeded_exponentials(seed: int, position: int, vocab: int, device: torch.device) -> torch.Tensor:
    """float32 [vocab] i.i.d. Exp(1), a function of (seed, position) only."""
    generator = torch.Generator(device=device).manual_seed(position_seed(seed, position))
    return torch.empty(vocab, device=device).exponential_(generator=generator)


def filter_logits(scaled: torch.Tensor, settings: RowSettings) -> torch.Tensor:
    """top-k, then top-p, then min-p on tempered logits scaled float32 [N, vocab] (each row's top at
    0), with the rows' settings (RowSettings); returns a copy with the dropped tokens at -inf (scaled
    itself when no row filters). Greedy rows are left as they are. Each filter keeps the tokens at or
    above a value, so the three make one floor per row, and what a row keeps depends on that row alone
    (ties stay or go together)."""
    if not settings.filters:
        return scaled
    vocab = scaled.shape[1]
    floor = settings.min_p_floor[:, None]
    if settings.max_top_k:
        # top-k: the k-th largest value is the floor, so the tokens tied with it all stay. One value
        # more than the largest k tells top-p below whether such ties run past the values ranked here.
        ranked = scaled.topk(min(settings.max_top_k + 1, vocab), dim=-1).values  # descending
        k = settings.top_k[:, None]
        kth = ranked.gather(1, (k - 1).clamp_min(0)).masked_fill(k == 0, _NEG_INF)
        floor = torch.maximum(floor, kth)
    else:
        kth = torch.full_like(floor, _NEG_INF)
    rows = settings.nucleus
    if rows.numel():
        nucleus_scaled = scaled if rows.numel() == scaled.shape[0] else scaled[rows]
        if settings.nucleus_within_top_k:
            nucleus_ranked = ranked[rows]
        else:  # a row without top-k ranks its whole vocabulary
            nucleus_ranked = nucleus_scaled.sort(dim=-1, descending=True).values
        top_p_floor = _top_p_floor(nucleus_scaled, nucleus_ranked, kth[rows], settings.top_p)
        floor = floor.index_copy(0, rows, torch.maximum(floor[rows], top_p_floor))
    return scaled.masked_fill(scaled < floor, _NEG_INF)


def _top_p_floor(
    scaled: torch.Tensor, ranked: torch.Tensor, kth: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The smallest value each row's nucleus keeps: float32 [R, 1], for rows scaled [R, vocab], their
    largest values ranked [R, W] in descending order (W = vocab, or more than the row's k), their
    top-k floor kth [R, 1] (-inf = no top-k) and top_p float64 [R]. Over the tokens top-k keeps, from
    the most likely: one stays while the mass before it is below top_p; tokens tied with the last
    one that stays have its value, so they stay too, whatever order a sort puts them in. The top
    token always stays."""
    ranked = ranked.masked_fill(ranked < kth, _NEG_INF)
    # sums in float64 (a float32 cumulative sum reaches 1 early); the top value is 0: no overflow
    weights = ranked.exp().double()
    total = weights.sum(dim=-1, keepdim=True)
    width = ranked.shape[1]
    if width < scaled.shape[1]:
        # the last ranked value still at or above the k-th: more tokens tied with it may follow
        # (computed for every row: asking whether any row needs it would wait for the GPU)
        more = ranked[:, -1:] > _NEG_INF
        extra = (scaled >= kth).sum(dim=-1, keepdim=True) - width
        total = total + torch.where(more, extra * kth.exp().double(), 0.0)
    probs = weights / total
    mass_before = probs.cumsum(dim=-1) - probs
    num_kept = (mass_before < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_min(1)
    return ranked.gather(1, num_kept - 1)
