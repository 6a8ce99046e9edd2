"""`kiln serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop."""

from __future__ import annotations

import argparse
import sys

from kiln.engine.cpu_args import add_cpu_arguments, cpu_config_from_args
from kiln.engine.expert_args import add_expert_arguments, expert_config_from_args
from kiln.engine.kv_cache_args import add_kv_cache_arguments, kv_cache_config_from_args
from kiln.engine.speculative.args import add_speculative_arguments, speculative_config_from_args
from kiln.server.tool_parsers import TOOL_PARSERS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve the engine over an OpenAI-compatible HTTP API (completions, chat, SSE streaming)",
        description="Run Kiln's OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics. Default model: the embedded SmolLM2-135M-Instruct GGUF.",
    )
    parser.add_argument("--model", default=None, help="a GGUF file or HF directory (default: embedded model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    parser.add_argument(
        "--max-queue", type=int, default=None, help="sequences allowed to wait beyond that before 503 (4x)"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="larger request bodies get 413 before they are read (default 4 MiB; 0 = no limit)",
    )
    parser.add_argument(
        "--allow-special-tokens-in-chat",
        action="store_true",
        help="let special-token text in chat message content (<|im_start|>) become control tokens "
        "(default: it is tokenized as text, so a user cannot forge a turn)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, default=None, help="KV-cache budget (default: engine's)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    add_kv_cache_arguments(parser)
    add_cpu_arguments(parser)
    add_expert_arguments(parser)
    parser.add_argument("--served-model-name", default=None, help="the model id clients send")
    parser.add_argument("--log-level", default="info")
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
    parser.add_argument(  # vLLM's two flags (docs/server.md: Tool calling)
        "--enable-auto-tool-choice",
        action="store_true",
        help='read the model\'s own tool calls for tool_choice "auto" (with --tool-call-parser)',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="the format the model writes tool calls in: hermes (Hermes, Qwen2.5/3), llama3_json, pythonic",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.engine.config import EngineConfig
    from kiln.engine.llm_engine import LLMEngine
    from kiln.models.config import ModelLoadError
    from kiln.server.app import DEFAULT_MAX_BODY_BYTES, create_app
    from kiln.server.launch import build_off_main_thread, served_model_name

    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        print("kiln serve: --enable-auto-tool-choice and --tool-call-parser go together", file=sys.stderr)
        return 2
    if args.max_queue is not None and args.max_queue < 0:
        print("kiln serve: --max-queue must be >= 0", file=sys.stderr)
        return 2
    if args.max_body_bytes is not None and args.max_body_bytes < 0:
        print("kiln serve: --max-body-bytes must be >= 0 (0 = no limit)", file=sys.stderr)
        return 2
    max_body_bytes = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else (args.max_body_bytes or None)
    try:
        config = EngineConfig(
            model=args.model,
            max_num_seqs=args.max_num_seqs,
            kv_cache_bytes=args.kv_cache_bytes,
            max_model_len=args.max_model_len,
            device=args.device,
            speculative=speculative_config_from_args(args),
            **kv_cache_config_from_args(args),
            **cpu_config_from_args(args),
            **expert_config_from_args(args),
        )
    except ValueError as exc:
        print(f"kiln serve: {exc}", file=sys.stderr)
        return 2
    print("kiln serve: loading model ...", file=sys.stderr, flush=True)
    try:
        if args.tp > 1 or args.ep > 1 or args.pp > 1:  # parallel: None on a torchrun rank > 0 (done)
            from kiln.distributed.launch import start_engine

            engine = start_engine(config, args.tp, ep_size=args.ep, pp_size=args.pp)
            if engine is None:
                return 0
        else:
            engine = build_off_main_thread(LLMEngine, config)
    except ModelLoadError as exc:  # a bad model file: its one-line, named error is the whole story
        print("kiln serve: " + " ".join(str(exc).splitlines()), file=sys.stderr)
        return 1
    print(f"kiln serve: KV cache: {engine.runner.kv_cache_description()}", file=sys.stderr, flush=True)
    name = args.served_model_name or served_model_name(args.model)
    app = create_app(
        engine,
        model_name=name,
        api_key=args.api_key,
        max_queue=args.max_queue,
        max_body_bytes=max_body_bytes,
        allow_special_tokens_in_chat=args.allow_special_tokens_in_chat,
        tool_call_parser=args.tool_call_parser,
    )
    print(f"kiln serve: {name} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
