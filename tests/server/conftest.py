"""Shared set-up for the server tests: the embedded SmolLM2 GGUF, loaded once per test process
(every engine and server in these tests shares its read-only weights), and a server factory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def loaded_smollm2():
    from kiln.loaders import load_model

    return load_model(device="cpu")


@pytest.fixture(scope="session")
def start_server(loaded_smollm2):
    """start_server(api_key=None, max_queue=None, **engine_kwargs) -> (ServerThread, app).
    The caller stops the server."""
    from kiln.engine import EngineConfig, LLMEngine
    from kiln.server.app import create_app
    from kiln.server.launch import ServerThread

    def start(api_key=None, max_queue=None, **engine_kwargs):
        engine_kwargs.setdefault("num_kv_blocks", 256)
        engine = LLMEngine(EngineConfig(device="cpu", **engine_kwargs), loaded=loaded_smollm2)
        app = create_app(engine, api_key=api_key, max_queue=max_queue)
        return ServerThread(app).start(), app

    return start
