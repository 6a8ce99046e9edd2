"""Tensor- and expert-parallel failure behaviour: a worker that dies or hangs makes the engine fail
fast with an error naming what happened (not hang), and no worker process outlives the engine or its
driver."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from kiln.distributed import TensorParallelEngine, TensorParallelError
from kiln.engine.config import EngineConfig
from kiln.engine.sampling_params import SamplingParams
from tests.distributed.checkpoints import write_checkpoint

PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def _start(checkpoint, timeout_s):
    engine = TensorParallelEngine(
        EngineConfig(model=checkpoint, device="cpu", num_kv_blocks=16), tp_size=2, timeout_s=timeout_s
    )
    engine.add_request("r", [5, 6, 7, 8], PARAMS)
    engine.step()  # the ranks are in step with each other
    return engine, engine.workers[0]


def test_killed_worker_fails_the_next_step_fast_and_names_it(checkpoint):
    engine, worker = _start(checkpoint, timeout_s=20)
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    assert _gone(worker.pid)
    with pytest.raises(TensorParallelError, match="shut down"):
        engine.step()


def assert_hung_rank_fails_the_step_in_5_s_and_is_killed(engine, worker, match: str) -> None:
    """SIGSTOP `worker` (alive, but it never answers), then the next engine step must raise
    TensorParallelError matching `match` after the engine's 5 s timeout, and the worker be gone."""
    os.kill(worker.pid, signal.SIGSTOP)
    # should the timeout ever not fire, end the test with a failure instead of hanging the suite
    rescue = threading.Timer(60.0, os.kill, (worker.pid, signal.SIGKILL))
    rescue.start()
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match=match):
            engine.step()
        elapsed = time.monotonic() - start
        assert 4.5 < elapsed < 30, elapsed
        worker.join(timeout=10)
        assert _gone(worker.pid)
    finally:
        rescue.cancel()
        if not _gone(worker.pid):
            os.kill(worker.pid, signal.SIGKILL)


def test_hung_worker_fails_the_step_after_the_collective_timeout_and_is_killed(checkpoint):
    engine, worker = _start(checkpoint, timeout_s=5)
    # alive but never joins the next collective
    assert_hung_rank_fails_the_step_in_5_s_and_is_killed(engine, worker, "did not finish within 5 s")


_DRIVER = """
import sys
from kiln.distributed import TensorParallelEngine
from kiln.engine.config import EngineConfig
engine = TensorParallelEngine(EngineConfig(model=sys.argv[1], device="cpu", num_kv_blocks=16), tp_size=2)
print(engine.workers[0].pid, flush=True)
sys.stdin.read()
"""


def test_workers_exit_when_the_driver_process_is_killed(checkpoint):
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, checkpoint], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        worker_pid = int(driver.stdout.readline())
        assert not _gone(worker_pid)
        driver.kill()  # SIGKILL: no atexit, no shutdown; the worker must notice on its own
        driver.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not _gone(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(worker_pid), f"worker {worker_pid} outlived its killed driver"
    finally:
        driver.kill()
        driver.wait(timeout=10)


def test_killed_expert_parallel_rank_fails_the_step_naming_it(tmp_path):
    # EP 2 over a tiny Mixtral: the token dispatch's all-to-all needs the dead rank
    from tests.distributed.moe_checkpoints import write_moe_checkpoint

    config = EngineConfig(model=write_moe_checkpoint(tmp_path, "mixtral"), device="cpu", num_kv_blocks=16)
    engine = TensorParallelEngine(config, tp_size=2, ep_size=2, timeout_s=20)
    engine.add_request("r", [5, 6, 7, 8], PARAMS)
    engine.step()
    (worker,) = engine.workers
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    assert _gone(worker.pid)


@pytest.mark.parametrize(
    "how, pp_size, rank",
    [("import", 1, "rank 1"), ("load", 1, "rank 1"), ("load", 2, "rank 1, pipeline stage 1")],
    ids=["before-joining", "loading-tp", "loading-pp"],
)
def test_a_worker_dying_at_start_up_fails_the_engine_at_once_naming_it(checkpoint, how, pp_size, rank):
    # before the fix: a rendezvous timeout after startup_timeout_s (30 s here) naming nobody, or gloo's
    # bare "Connection reset by peer"
    driver = os.path.join(os.path.dirname(__file__), "startup_failure_driver.py")
    result = subprocess.run(
        [sys.executable, driver, checkpoint, how, str(pp_size)], capture_output=True, text=True, timeout=120
    )
    line = next((x for x in result.stdout.splitlines() if x.startswith("FAILED")), result.stderr[-2000:])
    code = 7 if how == "import" else 9
    died = rf"tensor-parallel worker died during start-up: {rank} \(pid \d+\) exited with code {code}"
    assert re.search(rf"^FAILED after [\d.]+ s: TensorParallelError: {died}$", line), line
    assert float(line.split()[2]) < 10, line


@pytest.mark.parametrize("error", [KeyboardInterrupt, MemoryError])
def test_an_interrupt_on_rank_0_mid_step_shuts_the_engine_down_at_once(checkpoint, error):
    engine, worker = _start(checkpoint, timeout_s=5)
    model = engine.runner.model

    def interrupted(hidden):
        raise error("simulated")

    # rank 0 leaves the step after the worker joined its forward: the ranks are out of step
    model.compute_logits = interrupted
    start = time.monotonic()
    with pytest.raises(error, match="simulated"):
        engine.step()
    with pytest.raises(TensorParallelError, match="shut down"):
        engine.step()  # not a step over desynchronised ranks that times out blaming the worker
    engine.shutdown()
    assert time.monotonic() - start < 3  # no stop message waiting out the timeout for the worker
    worker.join(timeout=5)
    assert _gone(worker.pid)


def test_more_ranks_than_visible_gpus_are_refused_before_starting_workers(checkpoint, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(model=checkpoint, device="cuda", num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"2 ranks on this machine need 2 GPUs .* torch sees 1"):
        TensorParallelEngine(config, tp_size=2, timeout_s=5)
