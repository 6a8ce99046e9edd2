"""Several scheduler steps in flight through the pipeline (kiln.distributed.pipeline_lanes), on the
CPU over gloo: with 2 lanes rank 0 launches a lane's step while the other lane's is still in the
later stage, and every request's greedy tokens and their top-5 logprobs equal one process's; a
request aborted while its step is in flight is skipped; the lane scheduler balances and routes; the
lanes together run at most max_num_seqs sequences; and a SamplingError on rank 0 fails only its
requests, not the ranks (under TP as under PP lanes)."""

import os

import pytest

from kiln.distributed import TensorParallelEngine
from kiln.distributed.pipeline_lanes import LaneScheduler, lane_count, lane_max_num_seqs
from kiln.engine.block_manager import BlockManager
from kiln.engine.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence
from tests.distributed.checkpoints import write_checkpoint

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
LONG = [5, 77, 3, 101, 42, 42, 9, 120, 64, 1, 33, 7, 8, 9, 10, 11, 12, 13, 14]  # over one 16-slot block
PROMPTS = [LONG, [2, 3, 4], [9, 8, 7, 6], [1]]


def count_in_flight(engine) -> dict:
    """Wrap the runner's start / finish: the most steps that were started and not yet finished."""
    runner, state = engine.runner, {"now": 0, "most": 0, "started": 0}
    start, finish = runner.start, runner.finish

    def counting_start(batch):
        state["now"] += 1
        state["started"] += 1
        state["most"] = max(state["most"], state["now"])
        return start(batch)

    def counting_finish(started):
        state["now"] -= 1
        return finish(started)

    runner.start, runner.finish = counting_start, counting_finish
    return state


def generate(engine, prompts, abort_after_steps: int | None = None) -> dict:
    """request id -> (token ids, per-token logprob dicts, finish reason); with abort_after_steps, r0 is
    aborted after that many steps."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    results, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            results[out.request_id] = (list(out.token_ids), out.logprobs, out.finish_reason)
        steps += 1
        if steps == abort_after_steps:
            engine.abort_request("r0")
    return results


def run_aborting_failed_requests(engine, prompts, before_step=None) -> dict:
    """request id -> (token ids, finish reason) of `prompts` run to the end as the server runs them: a
    step's SamplingError aborts the requests it names; before_step(n) runs before the n-th step."""
    from kiln.engine.sampler import SamplingError

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, PARAMS)
    results, step = {}, 0
    while engine.has_unfinished_requests():
        step += 1
        if before_step is not None:
            before_step(step)
        try:
            outputs = engine.step()
        except SamplingError as exc:
            for request_id in exc.failures:
                engine.abort_request(request_id)
            continue
        for out in outputs:
            results[out.request_id] = (list(out.token_ids), out.finish_reason)
    return results


def assert_same_logprobs(got, expected, tol=1e-5):
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.keys() == b.keys(), f"step {step}: top-5 tokens differ"
        for token in a:
            bound = tol * max(1.0, abs(b[token]))
            assert abs(a[token] - b[token]) <= bound, (step, token, a[token], b[token])


@pytest.mark.parametrize("tp_size", [1, 2], ids=["pp2", "tp2_pp2"])
def test_two_lanes_keep_two_steps_in_flight_and_match_one_process(tp_size, tmp_path):
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=3, num_key_value_heads=2)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32)
    single = generate(LLMEngine(config), PROMPTS)
    with TensorParallelEngine(config, tp_size=tp_size, pp_size=2, timeout_s=30) as engine:
        assert engine.lanes == 2 and engine.micro_batches == 1
        in_flight = count_in_flight(engine)
        lanes = generate(engine, PROMPTS)
        assert [len(lane.running) + len(lane.waiting) for lane in engine.scheduler.lanes] == [0, 0]
        stats = engine.stage_stats()
        workers = list(engine.workers)
    assert in_flight["most"] == 2, "rank 0 never had two steps in flight"
    # every rank ran every step rank 0 started, one micro-batch each
    assert [s["steps"] for s in stats] == [in_flight["started"]] * (2 * tp_size)
    assert lanes.keys() == single.keys()
    for request_id, (tokens, logprobs, reason) in single.items():
        assert lanes[request_id][0] == tokens, request_id
        assert lanes[request_id][2] == reason == "length"
        assert_same_logprobs(lanes[request_id][1], logprobs)
    for process in workers:
        assert process.exitcode == 0
        assert not os.path.exists(f"/proc/{process.pid}")


def test_a_request_aborted_while_its_step_is_in_flight_is_skipped(tmp_path):
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32)
    prompts = PROMPTS[:2]
    single = generate(LLMEngine(config), prompts)
    with TensorParallelEngine(config, tp_size=1, pp_size=2, timeout_s=30) as engine:
        # step 1 launches lane 0 (r0), step 2 lane 1 (r1); r0 is aborted with its step in flight
        results = generate(engine, prompts, abort_after_steps=2)
        assert engine.block_manager.num_used_blocks == 0
    assert results["r0"][2] == "abort" and results["r0"][0] == []
    assert results["r1"][0] == single["r1"][0]


def test_lanes_need_a_pipeline_and_are_refused_by_name(tmp_path):
    path = write_checkpoint(tmp_path, "llama")
    with pytest.raises(ValueError, match="lanes=2; several steps in flight need pipeline parallelism"):
        TensorParallelEngine(EngineConfig(model=path, device="cpu"), tp_size=2, lanes=2)


def test_lanes_split_max_num_seqs_so_that_together_they_run_no_more():
    # each lane used to get ceil(max_num_seqs / lanes): 2 lanes at max_num_seqs 3 ran 4 sequences
    assert lane_max_num_seqs(3, 2) == [2, 1]
    assert lane_max_num_seqs(4, 2) == [2, 2]
    assert lane_max_num_seqs(7, 4) == [2, 2, 2, 1]
    assert lane_count(None, pp_size=4, max_num_seqs=2, speculative=False) == 2  # a lane runs >= 1
    assert lane_count(None, pp_size=2, max_num_seqs=1, speculative=False) == 1
    assert lane_count(None, pp_size=2, max_num_seqs=64, speculative=True) == 1
    with pytest.raises(ValueError, match=r"lanes=3 > max_num_seqs=2; every lane runs at least one"):
        lane_count(3, pp_size=3, max_num_seqs=2, speculative=False)


def test_two_lanes_never_run_more_than_max_num_seqs_sequences(tmp_path):
    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32, max_num_seqs=3)
    with TensorParallelEngine(config, tp_size=1, pp_size=2, timeout_s=30) as engine:
        assert [lane.max_num_seqs for lane in engine.scheduler.lanes] == [2, 1]
        for i in range(6):
            engine.add_request(f"r{i}", [5 + i, 6, 7], PARAMS)
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, len(engine.scheduler.running))
    assert most == 3


def _lane_scheduler(lanes: int) -> LaneScheduler:
    blocks = BlockManager(16, 4)
    return LaneScheduler([Scheduler(blocks, 4, 64, 64) for _ in range(lanes)])


def test_lane_scheduler_balances_requests_and_routes_finish_to_their_lane():
    scheduler = _lane_scheduler(2)
    seqs = [Sequence(f"r{i}", [1, 2, 3], SamplingParams()) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    assert [seq.lane for seq in seqs] == [0, 1, 0, 1, 0]
    assert len(scheduler.waiting) == 5 and scheduler.has_unfinished()
    batch = scheduler.lanes[1].schedule()
    assert batch.seqs == [seqs[1], seqs[3]]  # lane 1 schedules only its own
    scheduler.finish(seqs[3], "abort")
    assert seqs[3] not in scheduler.lanes[1].running and seqs[3].finish_reason == "abort"
    assert len(scheduler.running) == 1 and len(scheduler.waiting) == 3
    # a new request joins the emptier lane: lane 1 now holds one, lane 0 three
    late = Sequence("late", [4, 5], SamplingParams())
    scheduler.add(late)
    assert late.lane == 1


@pytest.mark.parametrize("pp_size", [1, 2], ids=["tp2", "pp2_lanes"])
def test_a_sampling_error_fails_only_its_requests_and_the_ranks_go_on(pp_size, tmp_path):
    # rank 0 could not sample one request (SamplingError names it): that is not a rank failure, so the
    # engine keeps its workers, the request is aborted as the server does, and the others complete.
    from kiln.engine.sampler import SamplingError

    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32)
    single = generate(LLMEngine(config), PROMPTS[:2])
    tp_size = 2 if pp_size == 1 else 1
    with TensorParallelEngine(config, tp_size=tp_size, pp_size=pp_size, timeout_s=30) as engine:
        check_seeds = engine.runner.sampler.check_seeds
        failed = {"done": False}

        def fail_r0_once(seqs):
            if not failed["done"] and any(s.request_id == "r0" for s in seqs):
                failed["done"] = True
                raise SamplingError({"r0": "cannot seed a generator (test)"})
            return check_seeds(seqs)

        engine.runner.sampler.check_seeds = fail_r0_once
        results = run_aborting_failed_requests(engine, PROMPTS[:2])
        assert failed["done"] and not engine.dead_workers()
    assert results["r0"][1] == "abort"
    assert results["r1"] == (single["r1"][0], "length")


def test_an_abort_pending_when_a_lane_step_raises_is_reported_by_the_next(tmp_path):
    """A lane step that raises a SamplingError after taking the pending aborts dropped them: the
    aborted request was never reported (LLMEngine.step keeps them; the lane step now does too)."""
    from kiln.engine.sampler import SamplingError

    path = write_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    config = EngineConfig(model=path, device="cpu", num_kv_blocks=32)
    with TensorParallelEngine(config, tp_size=1, pp_size=2, timeout_s=30) as engine:
        check_seeds = engine.runner.sampler.check_seeds
        state = {"armed": False, "raised_at": None, "step": 0}

        def fail_once(seqs):
            if state["armed"] and state["raised_at"] is None:
                state["raised_at"] = state["step"]
                raise SamplingError({seqs[0].request_id: "cannot seed a generator (test)"})
            return check_seeds(seqs)

        engine.runner.sampler.check_seeds = fail_once

        def abort_r2_and_arm(step):
            state["step"] = step
            if step == 4:
                engine.abort_request("r2")
                state["armed"] = True

        results = run_aborting_failed_requests(engine, PROMPTS[:3], abort_r2_and_arm)
        finished = {request_id: reason for request_id, (_, reason) in results.items() if reason}
        assert state["raised_at"] == 4  # the step that took r2's abort raised
        assert finished["r2"] == "abort" and set(finished) == {"r0", "r1", "r2"}
