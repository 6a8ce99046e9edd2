"""`kiln bench serve`: load test of `kiln serve` over loopback HTTP.

For each concurrency level C, C client tasks send --requests streaming /v1/completions requests in
total (each client takes the next request when its last one ends), every request decoding exactly
--max-tokens tokens (ignore_eos). Reported per level: requests/s, output tokens/s, time to first
token (TTFT) p50/p99 and inter-token latency (ITL: gaps between streamed chunks) p50/p99, as JSON
and a Markdown table. Without --url it starts its own server in this process (the embedded model
unless --model). Only loopback URLs are accepted, and each level is bounded by --timeout seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    completed: int
    failed: int
    seconds: float
    requests_per_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    errors: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=None, help="a running server (loopback only); default: start one here"
    )
    parser.add_argument("--model", default=None, help="model for the spawned server (default: embedded)")
    parser.add_argument("--device", default=None, help="device for the spawned server")
    parser.add_argument("--api-key", default=None, help="bearer key for --url servers that need one")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], help="client counts")
    parser.add_argument("--requests", type=int, default=None, help="requests per level (default 2x, >= 8)")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--timeout", type=float, default=300.0, help="wall-clock cap per level, seconds")
    parser.add_argument(
        "--json", default=None, help="result file (default bench/results/serve_<device>.json)"
    )


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _one_request(client, url: str, body: dict, headers: dict) -> tuple[float, list[float], int]:
    """Stream one completion; returns (TTFT s, inter-chunk gaps s, output tokens)."""
    start = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {response.status_code}: {text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                raise RuntimeError(f"stream error: {payload['error'].get('message')}")
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            if any(c.get("text") for c in payload.get("choices", ())):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    if first is None:
        raise RuntimeError("the stream carried no text")
    return first - start, gaps, tokens


async def run_level(base_url: str, model: str, concurrency: int, requests: int, args) -> LevelResult:
    import httpx

    url = f"{base_url}/v1/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ttfts: list[float] = []
    itls: list[float] = []
    errors: list[str] = []
    output_tokens = 0
    next_index = iter(range(requests))

    async def client_task(client):
        nonlocal output_tokens
        for i in next_index:
            body = {
                "model": model,
                "prompt": f"Request {i}: write a short story about the number {i}.",
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            try:
                ttft, gaps, tokens = await _one_request(client, url, body, headers)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            ttfts.append(ttft)
            itls.extend(gaps)
            output_tokens += tokens

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(client_task(client)) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=args.timeout)
        for task in pending:
            task.cancel()
        seconds = time.perf_counter() - start
    completed = len(ttfts)
    if pending:
        errors.append(f"level stopped at the {args.timeout:.0f} s timeout")

    def ms(value):
        return None if value is None else value * 1000.0

    return LevelResult(
        concurrency=concurrency,
        requests=requests,
        completed=completed,
        failed=requests - completed,
        seconds=seconds,
        requests_per_s=completed / seconds,
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / seconds,
        ttft_p50_ms=ms(percentile(ttfts, 50)),
        ttft_p99_ms=ms(percentile(ttfts, 99)),
        itl_p50_ms=ms(percentile(itls, 50)),
        itl_p99_ms=ms(percentile(itls, 99)),
        errors=errors[:10],
    )


def markdown(results: list[LevelResult]) -> str:
    def f(value):
        return "-" if value is None else f"{value:.1f}"

    lines = [
        "| clients | requests (ok/total) | seconds | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms "
        "| ITL p50 ms | ITL p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.completed}/{r.requests} | {r.seconds:.2f} | {r.requests_per_s:.2f} | "
            f"{r.output_tokens_per_s:.1f} | {f(r.ttft_p50_ms)} | {f(r.ttft_p99_ms)} | {f(r.itl_p50_ms)} | "
            f"{f(r.itl_p99_ms)} |"
        )
    return "\n".join(lines)


def _check_args(args) -> str | None:
    if args.url is not None:
        host = urlparse(args.url).hostname
        if host not in LOOPBACK_HOSTS:
            hosts = ", ".join(sorted(LOOPBACK_HOSTS))
            return f"--url {args.url}: only loopback servers ({hosts}) are benchmarked"
    if any(c < 1 for c in args.concurrency):
        return f"--concurrency {args.concurrency}: every level must be >= 1"
    if args.requests is not None and args.requests < 1:
        return f"--requests {args.requests}: expected >= 1"
    if args.max_tokens < 1:
        return f"--max-tokens {args.max_tokens}: expected >= 1"
    return None


def _spawn_server(args):
    """Load the engine and serve it on a free loopback port; returns the ServerThread."""
    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.loaders import load_model
    from kiln.server.app import create_app
    from kiln.server.launch import ServerThread, build_off_main_thread, served_model_name

    config = EngineConfig(model=args.model, device=args.device, max_num_seqs=max(args.concurrency))

    def build():
        loaded = load_model(args.model, device=str(config.resolved_device()), dtype=config.dtype)
        return LLMEngine(config, loaded=loaded)

    engine = build_off_main_thread(build)
    app = create_app(engine, model_name=served_model_name(args.model), max_queue=4 * max(args.concurrency))
    return ServerThread(app).start()


def run(args: argparse.Namespace) -> int:
    import httpx

    problem = _check_args(args)
    if problem:
        print(f"kiln bench serve: {problem}", file=sys.stderr)
        return 2
    server = None
    if args.url is None:
        print("kiln bench serve: starting a server (loading the model) ...", file=sys.stderr, flush=True)
        server = _spawn_server(args)
        base_url = server.url
    else:
        base_url = args.url.rstrip("/").removesuffix("/v1")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        # one short request first, so one-time costs (first kernels, allocator) don't land in level 1
        warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
        asyncio.run(run_level(base_url, model, 1, 1, warm))
        results = []
        for c in args.concurrency:
            requests = args.requests or max(8, 2 * c)
            results.append(asyncio.run(run_level(base_url, model, c, requests, args)))
            r = results[-1]
            print(
                f"  {c:>3} clients: {r.completed}/{r.requests} ok, {r.output_tokens_per_s:.1f} tok/s, "
                f"TTFT p50 {r.ttft_p50_ms or 0:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if server is not None:
            server.stop()
    device = args.device or ("server" if args.url else _default_device())
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        },
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "server": base_url if args.url else "spawned in-process",
        "model": model,
        "results": [asdict(r) for r in results],
    }
    print(markdown(results))
    path = args.json or os.path.join("bench", "results", f"serve_{device}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nJSON written to {path}", file=sys.stderr)
    return 0 if all(r.failed == 0 for r in results) else 1


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.bench.serve", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
