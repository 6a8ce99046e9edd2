"""Where an engine decode step's time goes on the CPU: the embedded SmolLM2 GGUF (Kiln's default
formats unless flags say otherwise), `--sequences` random prompts of `--prompt-len` tokens,
`--max-tokens` greedy tokens each, over `--rounds` rounds after one untimed. Each pure decode step
(every sequence past its prefill) is timed whole and by parts: the decoder layers' one-call decode
(kiln.models.cpu_flat_decode.FlatDecodeLayers: GEMMs, norms, RoPE, KV writes, paged attention), the
LM head module, and the rest (embedding, final norm, sampling, scheduling, detokenizing). Prints the
median milliseconds of each as one JSON object with the CPU model and ISA flags (kiln.environment.cpu).
Eager steps only: a compiled step (--compile-cpu-decode) is one graph, with no parts to time.

    OMP_NUM_THREADS=2 python scripts/cpu_decode_step_parts.py [--sequences 16] [--prompt-len 32]
        [--max-tokens 128] [--rounds 2] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kiln import environment
from kiln.bench.engine import _prompts
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.loaders import default_model_path, load_model
from kiln.models import cpu_flat_decode

_seconds = {"layers": 0.0, "head": 0.0}


def _timed(part: str, fn):
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _seconds[part] += time.perf_counter() - start

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    layers_call = cpu_flat_decode.FlatDecodeLayers.__call__
    cpu_flat_decode.FlatDecodeLayers.__call__ = _timed("layers", layers_call)
    path = default_model_path()
    config = EngineConfig(
        model=path, device="cpu", max_num_seqs=args.sequences, kv_cache_dtype=args.kv_cache_dtype
    )
    engine = LLMEngine(config, loaded=load_model(path, device="cpu"))
    heads = [m for name, m in engine.model.named_modules() if name.split(".")[-1] == "lm_head"]
    if len(heads) != 1:
        raise SystemExit(f"expected one lm_head module, found {len(heads)}")
    heads[0].forward = _timed("head", heads[0].forward)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    parts: dict[str, list[float]] = {"step": [], "layers": [], "head": [], "rest": []}
    for r in range(args.rounds + 1):  # round 0 untimed: buffers, the one-call decode's setup
        for i, prompt in enumerate(_prompts(args.sequences, args.prompt_len, vocab, seed=r)):
            engine.add_request(f"r{r}-{i}", prompt, params)
        produced = 0
        while engine.has_unfinished_requests():
            _seconds.update(layers=0.0, head=0.0)
            start = time.perf_counter()
            outputs = engine.step()
            step = time.perf_counter() - start
            now = sum(len(o.token_ids) for o in outputs)
            if r and produced >= args.sequences and now >= produced:  # a pure decode step
                parts["step"].append(step)
                parts["layers"].append(_seconds["layers"])
                parts["head"].append(_seconds["head"])
                parts["rest"].append(step - _seconds["layers"] - _seconds["head"])
            produced = max(produced, now)
    cpu_flat_decode.FlatDecodeLayers.__call__ = layers_call
    result = {
        "environment": environment.cpu(),
        "model": path,
        "sequences": args.sequences,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
        "decode_steps": len(parts["step"]),
        "median_ms": {part: 1e3 * statistics.median(values) for part, values in parts.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
