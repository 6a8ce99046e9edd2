"""SpeculativeConfig: which proposer guesses tokens, and how many per step."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """Speculative decoding settings (EngineConfig.speculative; None = off).

    method: "ngram" (prompt lookup: continue the latest earlier occurrence of the sequence's last n
        tokens, no extra model) or "draft" (a smaller model with the same tokenizer proposes).
    num_speculative_tokens: most tokens proposed per sequence per step (k); the target verifies them
        and adds one of its own, so a step emits 1 to k + 1 tokens.
    ngram_min, ngram_max: n-gram lengths tried, longest first.
    draft_model: the draft checkpoint (GGUF file, HF dir or random:<preset>), for method "draft".
    draft_num_kv_blocks: the draft's KV blocks (None = as many as the target's cache).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    draft_model: str | None = None
    draft_num_kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"SpeculativeConfig: method={self.method!r}, expected one of {METHODS}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(
                f"SpeculativeConfig: num_speculative_tokens={self.num_speculative_tokens!r}, "
                "expected an int >= 1"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"SpeculativeConfig: ngram_min={self.ngram_min}, ngram_max={self.ngram_max}, "
                "expected 1 <= ngram_min <= ngram_max"
            )
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("SpeculativeConfig: method 'draft' needs draft_model (a checkpoint path)")
        if self.draft_num_kv_blocks is not None and self.draft_num_kv_blocks < 1:
            raise ValueError(
                f"SpeculativeConfig: draft_num_kv_blocks={self.draft_num_kv_blocks}, expected >= 1"
            )
