"""`kiln bench engine --speculative ngram|draft`: single-stream speed-up of speculative decoding
against the same engine without it, measured in the same run on the same loaded model.

The task is repetitive on purpose (speculation pays off when the output repeats its context): two
completion prompts, a list to say again and a function to copy with a variable renamed, decoded
greedily until EOS or --max-tokens. Runs alternate (baseline, speculative,
baseline, ...) for --spec-repeats rounds so a noisy shared machine slows both alike; greedy outputs
must be token-identical, which the summary records. `--draft-layers N` (method draft) uses the
target's own first N decoder layers as the draft (same tokenizer, no second file).
"""

from __future__ import annotations

import dataclasses
import sys
import time

ITEMS = (
    "apple, banana, cherry, date, elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, "
    "orange, papaya, quince, raspberry, strawberry, tangerine"
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
# plain completion prompts (the embedded 135M chat model answers "repeat this" requests in the chat
# template with a short paraphrase; as text to continue it repeats the list / the code)
TASKS = (
    f"Fruits: {ITEMS}.\nThe same fruits again, in the same order: apple,",
    f"Original code:\n```python\n{CODE}```\n\nThe same code with `subtotal` renamed to `net`:\n```python\n"
    "def total_price(items, tax_rate):\n",
)


def task_prompts(tokenizer) -> list[list[int]]:
    """The benchmark's prompts as token ids."""
    return [tokenizer.encode(task, add_special_tokens=True) for task in TASKS]


def _draft_model(args, model_path: str, device: str):
    if args.speculative != "draft":
        return None
    from kiln.loaders import load_model, open_checkpoint

    if args.draft_layers:
        checkpoint = open_checkpoint(model_path, device)
        config = dataclasses.replace(checkpoint.config, num_layers=args.draft_layers)
        return load_model(dataclasses.replace(checkpoint, config=config), device=device)
    if args.draft_model is None:
        raise ValueError("--speculative draft needs --draft-model PATH or --draft-layers N")
    return load_model(args.draft_model, device=device)


def _timed_run(engine, prompt: list[int], max_tokens: int, tag: str):
    from kiln.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(tag, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    return final, time.perf_counter() - start


def bench_speculative(args, loaded, model_path: str, device: str):
    """(rows, summary): the fields of one single-stream kiln.bench.engine.Result for the baseline and
    one for speculation, and the speed-up, acceptance rate and token identity."""
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.engine.speculative.config import SpeculativeConfig

    spec = SpeculativeConfig(
        method=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        draft_model=_draft_model(args, model_path, device),
    )
    base_engine = LLMEngine(EngineConfig(device=device, max_num_seqs=1), loaded=loaded)
    spec_engine = LLMEngine(EngineConfig(device=device, max_num_seqs=1, speculative=spec), loaded=loaded)
    prompts = task_prompts(loaded.tokenizer)
    for engine in (base_engine, spec_engine):  # warm-up: first-call costs out of the timings
        _timed_run(engine, prompts[0], 8, "warmup")
    before = spec_engine.stats()
    seconds = {"base": 0.0, "spec": 0.0}
    tokens = {"base": 0, "spec": 0}
    ttft = {"base": 0.0, "spec": 0.0}
    identical = True
    for r in range(args.spec_repeats):
        for i, prompt in enumerate(prompts):
            outs = {}
            for name, engine in (("base", base_engine), ("spec", spec_engine)):
                out, elapsed = _timed_run(engine, prompt, args.max_tokens, f"{name}-{r}-{i}")
                outs[name] = out
                seconds[name] += elapsed
                tokens[name] += len(out.token_ids)
                ttft[name] += out.first_token_time - out.arrival_time
            identical &= outs["base"].token_ids == outs["spec"].token_ids
    after = spec_engine.stats()
    proposed = after.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    steps = after.spec_verify_steps - before.spec_verify_steps
    runs = args.spec_repeats * len(prompts)
    label = f"kiln-spec-{spec.method}"
    rows = []  # kiln.bench.engine.Result fields
    for name, system in (("base", "kiln"), ("spec", label)):
        rate = tokens[name] / seconds[name]
        rows.append(
            {
                "system": system,
                "scenario": "single-stream",
                "concurrency": 1,
                "output_tokens": tokens[name],
                "seconds": seconds[name],
                "tok_per_s": rate,
                "ttft_ms": 1e3 * ttft[name] / runs,
                "tpot_ms": 1e3 / rate,
            }
        )
    summary = {
        "spec_method": spec.method,
        "spec_num_speculative_tokens": spec.num_speculative_tokens,
        "spec_draft": (
            f"first {args.draft_layers} layers of the target" if args.draft_layers else args.draft_model
        )
        if spec.method == "draft"
        else None,
        "baseline_tok_s": rows[0]["tok_per_s"],
        "speculative_tok_s": rows[1]["tok_per_s"],
        "spec_speedup": rows[1]["tok_per_s"] / rows[0]["tok_per_s"],
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_proposed_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "spec_tokens_per_verify_step": (accepted + steps) / steps if steps else 0.0,
        "spec_outputs_identical": identical,
    }
    print(
        f"speculative {spec.method} k={spec.num_speculative_tokens}: {summary['spec_speedup']:.2f}x "
        f"({rows[0]['tok_per_s']:.1f} -> {rows[1]['tok_per_s']:.1f} tok/s), acceptance "
        f"{summary['spec_acceptance_rate']:.1%}, outputs identical: {identical}",
        file=sys.stderr,
    )
    return rows, summary
