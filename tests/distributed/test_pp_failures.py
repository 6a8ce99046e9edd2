"""Pipeline-parallel failure behaviour: a stage that dies or hangs mid-generation fails the step with
TensorParallelError naming the rank and its stage (or the timeout), within the timeout, and every
other process exits."""

import os
import signal
import time

import pytest

from kiln.distributed import TensorParallelEngine, TensorParallelError
from kiln.engine.config import EngineConfig
from kiln.engine.sampling_params import SamplingParams
from tests.distributed.checkpoints import write_checkpoint
from tests.distributed.test_tp_failures import _gone, assert_hung_rank_fails_the_step_in_5_s_and_is_killed

PARAMS = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_hidden_layers=3)


def _start(checkpoint, pp_size, timeout_s):
    engine = TensorParallelEngine(
        EngineConfig(model=checkpoint, device="cpu", num_kv_blocks=16), tp_size=1, pp_size=pp_size,
        timeout_s=timeout_s,
    )  # fmt: skip
    engine.add_request("r", [5, 6, 7, 8], PARAMS)
    engine.add_request("s", [9, 10], PARAMS)
    engine.step()
    engine.step()  # mid-generation: the stages have exchanged hidden states and logits
    return engine


def test_killed_middle_stage_fails_the_step_naming_it_and_every_rank_exits(checkpoint):
    engine = _start(checkpoint, pp_size=3, timeout_s=20)
    middle, last = engine.workers
    os.kill(middle.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(
        TensorParallelError, match=r"rank 1, pipeline stage 1 \(pid \d+\) exited with code -9"
    ):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30
    last.join(timeout=10)
    assert _gone(middle.pid) and _gone(last.pid)
    with pytest.raises(TensorParallelError, match="shut down"):
        engine.step()


def test_hung_last_stage_fails_the_step_after_the_timeout_and_is_killed(checkpoint):
    engine = _start(checkpoint, pp_size=2, timeout_s=5)
    (worker,) = engine.workers
    # alive, but never sends the logits rank 0 waits for
    match = "send/recv failed or did not finish within 5 s"
    assert_hung_rank_fails_the_step_in_5_s_and_is_killed(engine, worker, match)
