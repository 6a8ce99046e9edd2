"""Search strategies for `kiln tune`: which of an implementation's declared configs to try.

exhaustive: every config, in declared order (a budget, if given, keeps the first `budget`).
random:     a uniform sample of `budget` distinct configs (all of them when the space is smaller),
            reproducible from `seed`.
"""

from __future__ import annotations

import random

STRATEGIES = ("exhaustive", "random")


def candidates(
    configs: list[dict], strategy: str = "exhaustive", budget: int | None = None, seed: int = 0
) -> list[dict]:
    """The configs to try, without duplicates."""
    if strategy not in STRATEGIES:
        raise ValueError(f"kiln tune: unknown strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    if budget is not None and budget < 1:
        raise ValueError(f"kiln tune: budget must be at least 1, got {budget}")
    unique: list[dict] = []
    for config in configs:
        if config not in unique:
            unique.append(dict(config))
    if strategy == "random" and budget is not None and budget < len(unique):
        return random.Random(seed).sample(unique, budget)
    return unique[:budget] if budget is not None else unique
