"""`kiln profile --engine`: one decode step of the engine (the embedded model by default).

Needs `kiln.engine` (LLMEngine, EngineConfig, SamplingParams); raises ModuleNotFoundError with a clear
message when this build does not have it yet.
"""

from __future__ import annotations

import torch

from kiln.bench.ceilings import measure_ceilings
from kiln.profile.profiler import ProfileReport, profile_callable
from kiln.profile.ranges import range as profile_range

PROMPT = "Write a short poem about a kiln firing clay into stoneware."


def profile_engine_step(
    model: str | None = None, batch: int = 4, steps: int = 1, trace: str | None = None
) -> ProfileReport:
    """Prefill `batch` identical-length requests, take one warm-up decode step, then profile `steps`
    decode steps (each one `engine.step()` covering the whole batch)."""
    try:
        import kiln.engine as engine_module
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "kiln profile --engine: kiln.engine is not available in this build yet", name=exc.name
        ) from None
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sampling = engine_module.SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    engine = engine_module.LLMEngine(engine_module.EngineConfig(model=model, max_num_seqs=max(batch, 1)))
    for i in range(batch):
        engine.add_request(f"profile-{i}", PROMPT, sampling)
    engine.step()  # prefill

    def step():
        with profile_range("engine.step"):
            engine.step()

    return profile_callable(
        step, device, steps=steps, warmup=1, trace=trace, ceilings=measure_ceilings(device)
    )
