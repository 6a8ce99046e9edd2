"""`kiln generate`: stream one prompt's completion to the terminal, then TTFT and tokens/s."""

from __future__ import annotations

import argparse
import sys
import time

from kiln.engine.cpu_args import add_cpu_arguments, cpu_config_from_args
from kiln.engine.expert_args import add_expert_arguments, expert_config_from_args
from kiln.engine.kv_cache_args import add_kv_cache_arguments, kv_cache_config_from_args
from kiln.engine.speculative.args import add_speculative_arguments, speculative_config_from_args
from kiln.engine.structured_args import add_structured_arguments, structured_from_args
from kiln.entrypoints.logprob_report import format_token_logprobs


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate text for a prompt with the paged-KV engine (streams tokens)",
        description="Generate a completion with Kiln's engine; default model: the embedded "
        "SmolLM2-135M-Instruct GGUF.",
    )
    parser.add_argument("prompt", help="the prompt text (the user message with --chat)")
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0,
        help="divide positive (multiply negative) logits of prompt and output tokens by it; 1 = off",
    )  # fmt: skip
    parser.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="[-2, 2]: minus this for each token already output",
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0,
        help="[-2, 2]: minus this times the count of each token already output",
    )  # fmt: skip
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true", help="keep going past EOS up to --max-tokens")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--logprobs", type=int, default=None, metavar="N",
        help="after the completion, each output token's logprob and its top N alternatives",
    )  # fmt: skip
    parser.add_argument(
        "--prompt-logprobs", type=int, default=None, metavar="N",
        help="each prompt token's logprob given the ones before it (top N alternatives), with the "
        "prompt's total and perplexity",
    )  # fmt: skip
    add_structured_arguments(parser)
    add_kv_cache_arguments(parser)
    add_cpu_arguments(parser)
    add_expert_arguments(parser)
    parser.add_argument(  # tensor parallelism (kiln.distributed; README: Tensor parallelism)
        "--tp", type=int, default=1, help="tensor-parallel processes (spawned here, or under torchrun)"
    )
    parser.add_argument(  # expert parallelism (docs/expert_parallel.md)
        "--ep", type=int, default=1, help="MoE models: N ranks, each holding 1/N of the experts whole"
    )
    parser.add_argument(  # pipeline parallelism (docs/pipeline_parallel.md)
        "--pp", type=int, default=1, help="pipeline stages of the decoder layers (--tp x --pp ranks in all)"
    )
    add_speculative_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            min_tokens=args.min_tokens,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            logprobs=args.logprobs,
            prompt_logprobs=args.prompt_logprobs,
            structured_outputs=structured_from_args(args),
        )
        speculative = speculative_config_from_args(args)
    except ValueError as exc:
        print(f"kiln generate: {exc}", file=sys.stderr)
        return 2
    print("loading model ...", file=sys.stderr, flush=True)
    try:
        config = EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=1,
            speculative=speculative,
            **kv_cache_config_from_args(args),
            **cpu_config_from_args(args),
            **expert_config_from_args(args),
        )
        if args.tp > 1 or args.ep > 1 or args.pp > 1:  # parallel: None on a torchrun rank > 0 (done)
            from kiln.distributed.launch import start_engine

            engine = start_engine(config, args.tp, ep_size=args.ep, pp_size=args.pp)
            if engine is None:
                return 0
        else:
            engine = LLMEngine(config)
    except ValueError as exc:  # kiln.models.ModelLoadError is one: names the file and what is wrong
        print(f"kiln generate: {exc}", file=sys.stderr)
        return 2
    print(f"KV cache: {engine.runner.kv_cache_description()}", file=sys.stderr, flush=True)
    tokenizer = engine.tokenizer
    if args.chat:
        # the prompt is tokenized as text: typed special-token text cannot forge a turn
        try:
            prompt = tokenizer.encode_chat(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True
            )
        except ValueError as exc:  # e.g. a checkpoint without a chat template
            print(f"kiln generate: {exc}", file=sys.stderr)
            return 2
    else:
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True)
    start = time.perf_counter()
    try:
        engine.add_request("cli", prompt, params)
    except ValueError as exc:
        print(f"kiln generate: {exc}", file=sys.stderr)
        return 2
    printed = 0
    out = None
    prompt_logprobs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed = len(out.text)
            prompt_logprobs = out.prompt_logprobs or prompt_logprobs
    end = time.perf_counter()
    if out is None or out.first_token_time is None:
        print("\nkiln generate: no tokens were generated", file=sys.stderr)
        return 1
    n = len(out.token_ids)
    ttft = out.first_token_time - start
    decode = (n - 1) / (end - out.first_token_time) if n > 1 else 0.0
    print(
        f"\n--- TTFT {ttft * 1000:.1f} ms | {decode:.1f} tok/s decode | "
        f"{n / (end - start):.1f} tok/s overall | {n} tokens generated ({out.finish_reason}) | "
        f"prompt {len(prompt)} tokens"
    )
    if args.prompt_logprobs is not None and prompt_logprobs is not None:
        print(format_token_logprobs(tokenizer, prompt, prompt_logprobs, args.prompt_logprobs, "prompt"))
    if args.logprobs is not None and out.logprobs is not None:
        print(format_token_logprobs(tokenizer, out.token_ids, out.logprobs, args.logprobs, "output"))
    if speculative is not None:
        stats = engine.stats()
        rate = stats.spec_accepted_tokens / stats.spec_proposed_tokens if stats.spec_proposed_tokens else 0.0
        print(
            f"--- speculative ({speculative.method}, k={speculative.num_speculative_tokens}): "
            f"{stats.spec_accepted_tokens}/{stats.spec_proposed_tokens} proposed tokens accepted ({rate:.1%})"
        )
    return 0
