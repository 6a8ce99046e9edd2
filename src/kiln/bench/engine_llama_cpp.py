"""llama-cpp-python's rows for `kiln bench engine`, run in a child process.

llama.cpp is native code loaded beside torch: when it crashes (its AMX backend segfaults on some
Sapphire-Rapids-class hosts, ggml-org/llama.cpp#20824), an in-process call would take the whole
benchmark, Kiln's finished rows included, down with it. In a spawned child a crash becomes a
RuntimeError naming the exit signal, and the caller keeps what it has.
"""

from __future__ import annotations

import multiprocessing
import os
import time


def _time_llama_cpp(
    model_path: str, prompt: list[int], max_tokens: int, ttft_prompts: list[list[int]], warmup: list[int]
) -> dict:
    """In the child: load the GGUF, one untimed warm-up, then greedy decode of `prompt` for up to
    `max_tokens` tokens (llama.cpp stops at EOS; a logit bias against it would add a Python pass over
    the vocabulary per token, so the row counts the tokens it did produce) and one first-token time
    per TTFT prompt. Returns {"tokens", "seconds", "ttft_seconds", "system_info", "version"}."""
    import llama_cpp

    n_ctx = max([len(prompt) + max_tokens, *(len(p) + 1 for p in ttft_prompts)]) + 16
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=n_ctx, n_threads=os.cpu_count(), verbose=False)
    llm.create_completion(prompt=warmup, max_tokens=4, temperature=0.0)
    start = time.perf_counter()
    out = llm.create_completion(prompt=prompt, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0)
    seconds = time.perf_counter() - start
    ttft_seconds = []
    for p in ttft_prompts:  # random prompts share no prefix with the last one, so nothing is reused
        start = time.perf_counter()
        llm.create_completion(prompt=p, max_tokens=1, temperature=0.0)
        ttft_seconds.append(time.perf_counter() - start)
    info = llama_cpp.llama_print_system_info()
    return {
        "tokens": out["usage"]["completion_tokens"],
        "seconds": seconds,
        "ttft_seconds": ttft_seconds,
        "system_info": info.decode() if isinstance(info, bytes) else str(info),
        "version": llama_cpp.__version__,
    }


def _child(conn, function, args) -> None:
    try:
        conn.send(("ok", function(*args)))
    except BaseException as error:  # an exception, unlike a crash, comes back with its message
        conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        conn.close()


def run_llama_cpp(
    model_path: str,
    prompt: list[int],
    max_tokens: int,
    ttft_prompts: list[list[int]],
    warmup: list[int],
    timeout: float = 1800.0,
) -> dict:
    """_time_llama_cpp's result, computed in a spawned process (run_in_child)."""
    args = (model_path, prompt, max_tokens, ttft_prompts, warmup)
    return run_in_child(_time_llama_cpp, args, f"llama-cpp-python on {model_path}", timeout)


def run_in_child(function, args: tuple, what: str, timeout: float = 1800.0):
    """function(*args) computed in a spawned process (function and args picklable). Raises
    RuntimeError naming `what` when it raises, dies (its exit code is named: -11 is SIGSEGV) or
    exceeds `timeout` seconds (then it is killed)."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(child, function, args), daemon=True)
    process.start()
    child.close()  # the child's end lives in the child only: its death is EOF here
    try:
        if not parent.poll(timeout):
            process.kill()
            raise RuntimeError(f"{what} did not finish in {timeout:g} s")
        try:
            status, value = parent.recv()
        except EOFError:
            process.join()
            raise RuntimeError(
                f"{what}: the process died with exit code {process.exitcode} "
                "(negative: killed by that signal)"
            ) from None
    finally:
        parent.close()
        process.join(timeout=10)
    if status != "ok":
        raise RuntimeError(f"{what} failed: {value}")
    return value
