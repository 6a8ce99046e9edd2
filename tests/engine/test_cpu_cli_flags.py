"""`kiln generate` and `kiln serve` pass --cpu-format, --lm-head-format and --compile-cpu-decode to
the EngineConfig (default: None / None / off, the loader's timed choice), and refuse an unknown format."""

import pytest

import kiln.engine.llm_engine
from kiln.cli import build_parser
from kiln.models.config import ModelLoadError


def test_generate_and_serve_cpu_flags_reach_the_engine_config(monkeypatch, capsys):
    seen = []

    def engine(config, *args, **kwargs):
        seen.append((config.cpu_format, config.lm_head_format, config.compile_cpu_decode))
        raise ValueError("stop here")

    def build(cls, config):
        seen.append((config.cpu_format, config.lm_head_format, config.compile_cpu_decode))
        raise ModelLoadError("stop here")

    monkeypatch.setattr(kiln.engine.llm_engine, "LLMEngine", engine)
    # `kiln serve` needs uvicorn, which the GPU machine lacks: skip there rather than fail to collect
    monkeypatch.setattr(pytest.importorskip("kiln.server.launch"), "build_off_main_thread", build)
    flags = ["--cpu-format", "int4_bf16", "--lm-head-format", "int8", "--compile-cpu-decode"]
    flags += ["--device", "cpu"]
    args = build_parser().parse_args(["generate", "hi", *flags])
    assert args.func(args) == 2
    args = build_parser().parse_args(["serve", *flags])
    assert args.func(args) == 1
    args = build_parser().parse_args(["generate", "hi", "--device", "cpu"])
    assert args.func(args) == 2
    assert seen == [("int4_bf16", "int8", True), ("int4_bf16", "int8", True), (None, None, False)]
    for command in (["generate", "hi"], ["serve"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--cpu-format", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err
