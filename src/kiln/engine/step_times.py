"""StepTimes: where an engine step's wall time goes, phase by phase, summed over steps.

    schedule     Scheduler.schedule (block allocation, prefix matching)
    prepare      ModelRunner.prepare (the flat batch and its attention metadata as tensors)
    forward      ModelRunner.execute (the model and the sampled rows' logits)
    sample       the sampler (and speculative verification)
    postprocess  Scheduler.postprocess (append tokens, stop checks, free blocks)
    detokenize   incremental detokenization, stop strings, RequestOutputs

Always on (a perf_counter per phase, well under a microsecond a step); `kiln profile --engine`
prints the per-step mean of every phase.
"""

from __future__ import annotations

PHASES = ("schedule", "prepare", "forward", "sample", "postprocess", "detokenize")


class StepTimes:
    """seconds: phase -> wall seconds summed over `steps` steps (the engine counts the steps)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        """phase -> mean milliseconds per step (zeros before the first step)."""
        steps = max(self.steps, 1)
        return {phase: 1e3 * seconds / steps for phase, seconds in self.seconds.items()}
