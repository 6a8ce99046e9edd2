"""Starting a server: the engine from CLI-style options, the served model name, and a uvicorn server
on a background thread (what tests and `kiln bench serve` use to host their own server in-process)."""

from __future__ import annotations

import os
import socket
import threading
import time

import uvicorn

from kiln.server.app import DEFAULT_MODEL_NAME


def served_model_name(model: str | None) -> str:
    """The `model` id clients must send: the checkpoint's file or directory name."""
    if model is None:
        return DEFAULT_MODEL_NAME
    name = os.path.basename(os.path.normpath(model))
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


def build_off_main_thread(build, *args, **kwargs):
    """Return `build(*args, **kwargs)`, run in a short-lived thread (its exceptions re-raised here).

    The server computes on its engine-loop thread. With GNU OpenMP (PyTorch's CPU thread pool) every
    thread that runs a parallel region keeps its own pool of workers, and a second live pool slows the
    first: the embedded model decoded one stream at ~48 tok/s on the engine thread of a 2-core machine
    when the main thread had loaded it (its pool stays alive), ~84 tok/s when a thread that then exits
    loaded it. So the model is loaded here, and the main (HTTP) thread never runs parallel torch ops."""
    box: dict = {}

    def target():
        try:
            box["value"] = build(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as is
            box["error"] = exc

    thread = threading.Thread(target=target, name="kiln-load", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on host:port from a daemon thread. `start()` returns once it accepts
    connections (or raises); `stop()` shuts it down (the app's lifespan stops the engine loop)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="kiln-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"kiln serve: the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
