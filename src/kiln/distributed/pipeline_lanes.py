"""Several scheduler steps in flight through a pipeline: the requests split into lanes.

With P pipeline stages, one step at a time leaves every stage idle while the others run it (the
micro-batches of one step only fill the pipe within that step, and a decode wave of one sequence
cannot be split). A sequence's next step needs its last token, so steps of the *same* sequences
cannot overlap; steps of different sequences can. So rank 0 splits the requests into `lanes` (P by
default), each with its own Scheduler over the one shared BlockManager, and keeps one step per lane
in flight: while the last stage runs lane 0's step, the first stage already runs lane 1's
(TensorParallelEngine.step: finish the lane's previous step, then schedule and launch its next one).

Why this is safe with one shared block pool: a lane schedules only its own sequences, and only after
its previous step finished, so no sequence is in two steps at once; a block is registered in the
prefix cache only when the step that computed it has finished on every stage; every stage runs the
steps in launch order, so a block freed by one lane and reused by another is written by the later
step after the earlier one read it; and a sequence aborted while its step is in flight is skipped
when that step finishes (LLMEngine._advance).

A request joins the lane with the fewest requests; max_num_seqs is split over the lanes (lane i runs
max_num_seqs // L + (i < max_num_seqs % L) sequences at most, so all lanes together run max_num_seqs),
the token budget is per step.
"""

from __future__ import annotations

from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence


class LaneScheduler:
    """The engine's `scheduler` when requests run in lanes: `lanes[i]` schedules lane i's sequences;
    add / finish / has_unfinished and the counts the engine reports span all lanes."""

    def __init__(self, lanes: list[Scheduler]):
        if not lanes:
            raise ValueError("LaneScheduler: expected at least one lane")
        self.lanes = lanes

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for lane in self.lanes for seq in lane.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [seq for lane in self.lanes for seq in lane.running]

    @property
    def num_preemptions(self) -> int:
        return sum(lane.num_preemptions for lane in self.lanes)

    def add(self, seq: Sequence) -> None:
        """Queue seq on the lane holding the fewest requests (the first of those on a tie)."""
        loads = [len(lane.waiting) + len(lane.running) for lane in self.lanes]
        lane = loads.index(min(loads))
        seq.lane = lane
        self.lanes[lane].add(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq in its own lane (see Scheduler.finish)."""
        self.lanes[seq.lane].finish(seq, reason)

    def has_unfinished(self) -> bool:
        return any(lane.has_unfinished() for lane in self.lanes)


def lane_count(lanes: int | None, pp_size: int, max_num_seqs: int, speculative: bool) -> int:
    """How many lanes the engine runs: `lanes`, or by default pp_size (1 with speculative decoding,
    whose proposer works step by step), never more than max_num_seqs (a lane runs at least one
    sequence). ValueError for an explicit count those rules refuse."""
    if lanes is None:
        return 1 if speculative else max(1, min(pp_size, max_num_seqs))
    if lanes < 1 or (lanes > 1 and (pp_size < 2 or speculative)):
        raise ValueError(
            f"TensorParallelEngine: lanes={lanes}; several steps in flight need pipeline parallelism "
            "(pp_size >= 2) and no speculative decoding, else use lanes=1"
        )
    if lanes > max_num_seqs:
        raise ValueError(
            f"TensorParallelEngine: lanes={lanes} > max_num_seqs={max_num_seqs}; every lane runs at least "
            f"one sequence, so use lanes <= {max_num_seqs} (or raise max_num_seqs)"
        )
    return lanes


def lane_max_num_seqs(max_num_seqs: int, lanes: int) -> list[int]:
    """Each lane's share of max_num_seqs, summing to it (the first lanes take the remainder)."""
    base, extra = divmod(max_num_seqs, lanes)
    return [base + (1 if lane < extra else 0) for lane in range(lanes)]
