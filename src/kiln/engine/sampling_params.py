"""SamplingParams: how one request's tokens are chosen and when its generation stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# what torch.Generator.manual_seed takes (negative seeds are used modulo 2**64)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    temperature 0 means greedy (argmax). top_k=-1 and top_p=1.0 and min_p=0.0 switch those filters off.
    seed: a per-request generator, so the same seed gives the same tokens whatever else is batched;
        an integer in [-2**63, 2**64 - 1], the range torch.Generator takes.
    stop: strings that end generation; the returned text stops just before the stop string.
    stop_token_ids: extra token ids that end generation (like EOS; the token is kept in token_ids).
    logprobs: None, or the number of top alternatives to return per output token (0 = only the chosen).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the bad field and the accepted range."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams: max_tokens={self.max_tokens!r}, expected an int >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"SamplingParams: temperature={self.temperature}, expected >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r}, expected -1 (off) or an int >= 1")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams: top_p={self.top_p}, expected in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams: min_p={self.min_p}, expected in [0, 1]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"SamplingParams: logprobs={self.logprobs!r}, expected None or an int >= 0")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(
                f"SamplingParams: seed={self.seed!r}, expected None or an int in [-2**63, 2**64 - 1]"
            )
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingParams: stop={self.stop!r}, expected a list of non-empty strings")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
