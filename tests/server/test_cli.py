"""`kiln serve` is wired into the `kiln` command, parses its options, and refuses bad ones before
loading a model."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from kiln.cli import build_parser, main  # noqa: E402
from kiln.server import cli as serve_cli  # noqa: E402
from kiln.server.launch import served_model_name  # noqa: E402


def test_kiln_serve_parses_its_options():
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "9123",
            "--api-key",
            "k",
            "--max-num-seqs",
            "8",
            "--max-queue",
            "3",
            "--device",
            "cpu",
        ]
    )
    assert args.func is serve_cli.run
    assert (args.host, args.port, args.api_key, args.max_num_seqs, args.max_queue, args.device) == (
        "127.0.0.1",
        9123,
        "k",
        8,
        3,
        "cpu",
    )


def test_kiln_serve_rejects_bad_options_without_loading_a_model(capsys):
    assert main(["serve", "--max-queue", "-1"]) == 2
    assert main(["serve", "--max-num-seqs", "0"]) == 2
    assert "max_num_seqs" in capsys.readouterr().err
    # vLLM's tool-calling flags go together, and the parser is one Kiln has
    assert main(["serve", "--enable-auto-tool-choice"]) == 2
    assert main(["serve", "--tool-call-parser", "hermes"]) == 2
    assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    args = build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")


def test_served_model_name_is_the_checkpoint_name():
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Llama-3.2-1B.Q4_0.gguf") == "Llama-3.2-1B.Q4_0"
    assert served_model_name("/models/qwen2-0.5b/") == "qwen2-0.5b"


def test_build_off_main_thread_returns_the_value_built_on_another_thread():
    import threading

    from kiln.server.launch import build_off_main_thread

    def build(a, b=0):
        return a + b, threading.current_thread().name

    value, thread_name = build_off_main_thread(build, 2, b=3)
    assert value == 5 and thread_name == "kiln-load" != threading.current_thread().name


def test_build_off_main_thread_reraises_the_builders_error():
    from kiln.server.launch import build_off_main_thread

    def build():
        raise ValueError("malformed model file")

    with pytest.raises(ValueError, match="malformed model file"):
        build_off_main_thread(build)


def test_kiln_serve_gives_a_bad_model_files_named_error_on_one_line_and_exits_1(tmp_path, capsys):
    """A named load error used to come wrapped in a traceback."""
    import os

    path = tmp_path / "noise.gguf"
    path.write_bytes(os.urandom(4096))
    assert main(["serve", "--model", str(path), "--device", "cpu", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kiln serve: ") and "noise.gguf: not a readable GGUF file" in last


def test_kiln_serve_limit_options():
    args = build_parser().parse_args(["serve", "--max-body-bytes", "1000", "--allow-special-tokens-in-chat"])
    assert args.max_body_bytes == 1000 and args.allow_special_tokens_in_chat
    args = build_parser().parse_args(["serve"])
    assert args.max_body_bytes is None and not args.allow_special_tokens_in_chat
    assert main(["serve", "--max-body-bytes", "-1"]) == 2
