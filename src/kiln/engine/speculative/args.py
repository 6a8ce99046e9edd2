"""The speculative-decoding command-line flags `kiln generate`, `kiln serve` and `kiln bench engine`
share, and the SpeculativeConfig they build."""

from __future__ import annotations

import argparse

from kiln.engine.speculative.config import METHODS, SpeculativeConfig


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """--speculative ngram|draft, --num-speculative-tokens K, --draft-model PATH, --ngram-min/--ngram-max."""
    parser.add_argument(
        "--speculative",
        choices=METHODS,
        default=None,
        help="speculative decoding: 'ngram' (prompt lookup) or 'draft' (--draft-model proposes); default off",
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="tokens proposed per step (with --speculative)"
    )
    parser.add_argument(
        "--draft-model", default=None, help="draft checkpoint (GGUF, HF dir or random:<preset>) for 'draft'"
    )
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest n-gram matched (ngram)")
    parser.add_argument("--ngram-max", type=int, default=4, help="longest n-gram matched (ngram)")


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig the flags ask for, None without --speculative (ValueError on bad values)."""
    if args.speculative is None:
        if args.draft_model is not None:
            raise ValueError("--draft-model needs --speculative draft")
        return None
    return SpeculativeConfig(
        method=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=args.draft_model,
    )
