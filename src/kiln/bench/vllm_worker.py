"""Runs vLLM on one job of `kiln bench engine --vllm-python`, in vLLM's own interpreter.

vLLM pins its own torch and transformers, so it lives in its own environment, and this file imports
nothing from Kiln: `kiln.bench.engine_vllm` writes a job file and runs

    <vllm-python> vllm_worker.py job.json

The job (JSON): {"model": HF directory, "dtype": "bfloat16", "max_tokens": int,
"max_num_seqs": int, "max_model_len": int, "runs": {concurrency: [[token ids], ...]},
"ttft_prompts": [[token ids], ...]}. The worker prints one JSON line per result, prefixed
"KILN-RESULT " (vLLM logs on the same streams), each with "vllm_version":
  {"scenario": "single-stream" | "concurrent", "concurrency", "output_tokens", "seconds"}: one offline
      `LLM.generate` of the run's prompts, greedy, ignore_eos, max_tokens each, after one untimed run
      of the same batch size on other prompts;
  {"scenario": "ttft", "seconds": [...]}: per prompt, `generate` with max_tokens=1 (prefill + first
      token), each prompt new to the engine, so its prefix cache cannot serve it.
"""

from __future__ import annotations

import json
import sys
import time

PREFIX = "KILN-RESULT "


def _emit(row: dict, version: str) -> None:
    print(PREFIX + json.dumps({**row, "vllm_version": version}), flush=True)


def main() -> None:
    with open(sys.argv[1]) as f:
        job = json.load(f)
    import vllm  # vLLM's interpreter, not Kiln's
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        seed=0,
    )
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for concurrency, prompts in job["runs"].items():
        warm = [[(t + 1) % 100 + 100 for t in p] for p in prompts]  # other tokens: no prefix-cache hits
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        c = int(concurrency)
        _emit(
            {
                "scenario": "single-stream" if c == 1 else "concurrent",
                "concurrency": c,
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "seconds": seconds,
            },
            vllm.__version__,
        )
    if job.get("ttft_prompts"):
        seconds = []
        for prompt in job["ttft_prompts"]:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
        _emit({"scenario": "ttft", "seconds": seconds}, vllm.__version__)


if __name__ == "__main__":
    main()
