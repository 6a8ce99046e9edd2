"""What structured outputs cost the sampler a step on this host: `Sampler.__call__` on [rows, vocab]
logits of the embedded SmolLM2's vocabulary, greedy rows without a constraint against rows under a JSON
schema (inside a string, where nearly every token may come next, and just after "{", where two may:
the matcher catches up, fills its bitmask, and the mask is applied), and the mask application alone,
Kiln's byte-table expansion against xgrammar's own CPU kernel. Each line is the mean of `--calls`
calls.

    OMP_NUM_THREADS=2 python scripts/structured_outputs_step_cost.py --rows 1,16
"""

from __future__ import annotations

import argparse
import itertools
import time
from functools import partial

import numpy as np
import torch

from kiln.engine.sampler import Sampler
from kiln.engine.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.engine.sequence import Sequence
from kiln.engine.structured_outputs import StructuredOutputs, apply_grammar_masks
from kiln.loaders import default_model_path, open_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "bio": {"type": "string"}},
    "required": ["name", "age", "bio"],
}
# where the rows are in their object: inside a string nearly every token may come next, after "{" only
# a quote or whitespace (xgrammar's kernel is fast on the first, slow on the second)
PREFIXES = {
    "in a string": '{"name": "Ann", "age": 31, "bio": "She likes pottery and long walks by',
    'after "{"': "{",
}


def _mean_ms(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    import xgrammar

    checkpoint = open_checkpoint(default_model_path())
    tokenizer, vocab = checkpoint.tokenizer, checkpoint.config.vocab_size
    compiler = StructuredOutputs(tokenizer, vocab, tokenizer.eos_token_ids)
    sampler = Sampler(torch.device("cpu"))

    def batch(rows: int, constrained: bool, prefix: list[int]) -> list[Sequence]:
        seqs = []
        for i in range(rows):
            so = StructuredOutputsParams(json=SCHEMA) if constrained else None
            seq = Sequence(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, structured_outputs=so))
            seq.token_ids += prefix
            if constrained:
                seq.grammar = compiler.new_state(so)
                seq.grammar.catch_up(seq)
            seqs.append(seq)
        return seqs

    print(f"vocabulary {vocab}, {torch.get_num_threads()} threads")
    for rows, (where, text) in itertools.product((int(r) for r in args.rows.split(",")), PREFIXES.items()):
        prefix = tokenizer.encode(text, add_special_tokens=False)
        logits = torch.randn(rows, vocab)
        plain, constrained = batch(rows, False, prefix), batch(rows, True, prefix)
        words = np.full((rows, -(-vocab // 32)), -1, dtype=np.int32)
        for j, seq in enumerate(constrained):
            seq.grammar.fill(words, j)
        cases = {
            "sampler, plain rows": partial(sampler, logits, plain),
            "sampler, JSON-schema rows": partial(sampler, logits, constrained),
            "masks only (Kiln: fill + byte table + copy)": partial(apply_grammar_masks, logits, constrained),
            "mask apply only (xgrammar's CPU kernel + copy)": partial(
                _xgrammar_apply, xgrammar, logits, torch.from_numpy(words)
            ),
        }
        for r in range(args.rounds):
            for name, fn in cases.items():
                print(f"rows {rows:3d} {where:11s} round {r}: {name:48s} {_mean_ms(fn, args.calls):7.3f} ms")


def _xgrammar_apply(xgrammar, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    xgrammar.apply_token_bitmask_inplace(logits.clone(), bitmask)


if __name__ == "__main__":
    main()
