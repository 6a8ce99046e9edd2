"""Sampler: picks the next token of every sequence of a batch from its logits.

Greedy rows take the argmax. Other rows: logits / temperature, then top-k, then top-p (nucleus,
over the top-k-renormalized distribution), then min-p (drop tokens below min_p * the top
probability), then one draw. The draw is an exponential race, argmax(p / E) with E ~ Exp(1) i.i.d.,
which samples exactly p; a request with a seed draws its E from its own torch.Generator, so its
tokens depend only on its seed and its logits, never on what else is in the batch.

Numerics: the logits are shifted by their row maximum before dividing by the temperature, and the
temperature is clamped to float32's smallest normal number, so temperature -> 0 gives the argmax
(never inf / inf = NaN); top-p always keeps the top token, so top_p -> 0 keeps just it.

Isolation: per-request set-up that can fail (a seed the generator refuses) runs for every row before
anything is drawn; a failure raises SamplingError naming those requests, with no generator advanced,
so the caller can drop them and run the same step again for the rest.
"""

from __future__ import annotations

import torch

from kiln.engine.argmax import row_argmax
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.sequence import Sequence

_TINY = torch.finfo(torch.float32).tiny


class SamplingError(RuntimeError):
    """Sampling could not start for some requests of the batch (nothing was drawn for any row).

    failures: request_id -> what went wrong. The other requests are untouched: the step can be run
    again without the failed ones and samples exactly what it would have."""

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
        """logits: float32 [N, vocab], row i for seqs[i]. Returns N token ids and, per row, the
        logprobs dict (top-n + chosen token, natural log of the unmodified distribution) or None."""
        params = [s.params for s in seqs]
        if all(p.greedy for p in params):
            tokens = row_argmax(logits)
        else:
            self._make_generators(seqs, logits.device)
            tokens = self._sample(logits, seqs)
        token_list = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        if any(p.logprobs is not None for p in params):
            logprobs = self.token_logprobs(logits, tokens, params)
        return token_list, logprobs

    @staticmethod
    def _make_generators(seqs: list[Sequence], device: torch.device) -> None:
        """Seed the generator of every seeded sampling row that has none yet; SamplingError names the
        rows whose seed the generator refuses. Runs before any draw, so a failure advances nothing."""
        failures = {}
        for seq in seqs:
            params = seq.params
            if params.seed is None or params.greedy or seq.generator is not None:
                continue
            try:
                seq.generator = torch.Generator(device=device).manual_seed(params.seed)
            except (ValueError, TypeError, OverflowError, RuntimeError) as exc:
                failures[seq.request_id] = f"cannot seed a generator with seed={params.seed!r} ({exc})"
        if failures:
            raise SamplingError(failures)

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The generator seq's random draws come from: its own when it has a seed, else the shared one."""
        return seq.generator if seq.params.seed is not None else self.generator

    def make_generators(self, seqs: list[Sequence], device: torch.device) -> None:
        """Seed the per-request generators of seeded sampling rows (SamplingError as in __call__)."""
        self._make_generators(seqs, device)

    @classmethod
    def probs(cls, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """The distribution each row samples from: float32 [N, vocab], softmax of logits [N, vocab]
        divided by the row's temperature, after its top-k, top-p and min-p filters (greedy rows get
        temperature 1 and no filters; callers take their argmax instead)."""
        vocab = logits.shape[1]
        device = logits.device
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        # (logits - max) / T is <= 0 and finite or -inf: the top token stays at 0 however small T is
        logits = logits.float()
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        scaled = shifted / temps.clamp_min(_TINY)[:, None]
        sampling = [p for p in params if not p.greedy]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in sampling):
            scaled = cls._filter(scaled, params, sampling, vocab)
        return scaled.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [s.params for s in seqs]
        vocab = logits.shape[1]
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        probs = self.probs(logits, params)
        # the noise is indexed by token id, never by rank or batch row, so a seeded request draws the
        # same token whatever filters the other rows of its batch use
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.params.seed is None]
        if unseeded:
            rows = torch.empty(len(unseeded), vocab, device=device)
            noise[unseeded] = rows.exponential_(generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.params.seed is not None:
                noise[i].exponential_(generator=seq.generator)
        choice = row_argmax(probs / noise)
        return torch.where(greedy, row_argmax(logits), choice)

    @staticmethod
    def _filter(scaled: torch.Tensor, params, sampling, vocab: int) -> torch.Tensor:
        """top-k, then top-p, then min-p on the tempered logits [N, vocab]; dropped tokens -> -inf."""
        device = scaled.device
        # only the top max-k ranks can survive: topk is much cheaper than sorting the whole vocabulary
        width = max((p.top_k if 0 < p.top_k < vocab else vocab) for p in sampling)
        if width < vocab:
            ranked, order = scaled.topk(width, dim=-1)  # sorted, descending
        else:
            ranked, order = scaled.sort(dim=-1, descending=True)
        rank = torch.arange(width, device=device)[None, :]
        k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
        ranked = ranked.masked_fill(rank >= k[:, None], float("-inf"))
        probs = ranked.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        # keep a token while the mass ranked strictly above it is below top_p; the first always stays
        # (top_p can round to 0 in float32, and 0 >= 0 would drop it)
        beyond = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (rank > 0)
        ranked = ranked.masked_fill(beyond, float("-inf"))
        min_p = torch.tensor([p.min_p for p in params], device=device)
        ranked = ranked.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
        return torch.full_like(scaled, float("-inf")).scatter_(1, order, ranked)

    @staticmethod
    def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params) -> list[dict[int, float] | None]:
        """Per row of logits [N, vocab] (float32), for chosen tokens int64 [N]: None when params[i].logprobs
        is None, else {token id: logprob} of the top params[i].logprobs tokens and the chosen one
        (natural log of the unmodified distribution)."""
        logp = logits.float().log_softmax(dim=-1)
        chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
        max_n = min(max(p.logprobs or 0 for p in params), logp.shape[1])
        top_vals, top_ids = logp.topk(max_n, dim=-1) if max_n > 0 else (None, None)
        out: list[dict[int, float] | None] = []
        token_list = tokens.tolist()
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            entry: dict[int, float] = {}
            if p.logprobs > 0:
                entry = dict(
                    zip(top_ids[i, : p.logprobs].tolist(), top_vals[i, : p.logprobs].tolist(), strict=True)
                )
            entry[token_list[i]] = chosen[i]
            out.append(entry)
        return out
