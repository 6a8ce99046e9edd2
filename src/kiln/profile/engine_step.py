"""`kiln profile --engine`: decode steps of the engine (the embedded model by default), timed and profiled.

Reports the per-kernel table (kiln.profile.profiler), the decode throughput of the batch measured
without the profiler, and the share of kernel time spent in Kiln's own kernels: the Triton kernels
defined in `kiln.*` (matched by name, which also covers kernels replayed from CUDA graphs, whose
launches have no enclosing op). cuBLAS, aten and copy kernels are the rest. On the CPU, Kiln's ops run
as PyTorch CPU operators, so that share is 0 there; `op_share` (kernel time mapped to any registered
Kiln op) is the CPU's number.

Needs `kiln.engine` (LLMEngine, EngineConfig, SamplingParams); raises ModuleNotFoundError with a clear
message when this build does not have it yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kiln.bench.ceilings import measure_ceilings
from kiln.profile.kernel_ops import triton_kernel_ops
from kiln.profile.profiler import ProfileReport, profile_callable
from kiln.profile.ranges import range as profile_range

PROMPT = "Write a short poem about a kiln firing clay into stoneware."


@dataclass
class EngineStepProfile:
    """report: the profiled decode steps. decode_step_ms / decode_tok_s: one unprofiled decode step of
    the whole batch (mean over `timed_steps`) and batch / that time. kiln_share: fraction of kernel time
    in Kiln's Triton kernels; op_share: fraction mapped to a registered Kiln op. phase_ms: the
    timed steps' mean wall time per phase (kiln.engine.step_times: schedule, prepare, forward, sample,
    postprocess, detokenize). compiled_decode: the CPU decode step ran compiled."""

    report: ProfileReport
    batch: int
    decode_step_ms: float
    decode_tok_s: float
    kiln_share: float
    op_share: float
    phase_ms: dict[str, float] | None = None
    compiled_decode: bool = False


def kiln_triton_kernel_names() -> set[str]:
    """Names of the @triton.jit functions in the imported kiln modules (a Triton kernel runs under its
    function's name). Empty when Triton is not installed."""
    return set(triton_kernel_ops())


def kernel_shares(report: ProfileReport, kiln_names: set[str]) -> tuple[float, float]:
    """(share of kernel time in kernels named in `kiln_names`, share in kernels mapped to a Kiln op)."""
    if report.total_us <= 0:
        return 0.0, 0.0
    kiln_us = sum(r.total_us for r in report.kernels if r.name.split("(")[0].strip() in kiln_names)
    op_us = sum(r.total_us for r in report.kernels if r.op is not None)
    return kiln_us / report.total_us, op_us / report.total_us


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_engine_step(
    model: str | None = None,
    batch: int = 4,
    steps: int = 1,
    trace: str | None = None,
    device: str | None = None,
    timed_steps: int = 5,
    compile_cpu_decode: bool = False,
    cpu_format: str | None = None,
    lm_head_format: str | None = None,
    eager: bool = False,
) -> EngineStepProfile:
    """Prefill `batch` identical-length requests, take one warm-up decode step, time `timed_steps`
    decode steps, then profile `steps` more (each one `engine.step()` covering the whole batch).
    model: a GGUF file, HF dir or `random:<preset>`; device: cpu | cuda (default: cuda when present).
    compile_cpu_decode: EngineConfig's (the warm-up step compiles the batch's size); cpu_format,
    lm_head_format: EngineConfig's CPU weight formats (None: the loader's choice). eager: no CUDA graphs
    (EngineConfig.enforce_eager): every op call then declares its case, so a CUDA profile puts the
    decode step's ops on the roofline (graph replays declare nothing), at the launches' cost."""
    try:
        import kiln.engine as engine_module
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "kiln profile --engine: kiln.engine is not available in this build yet", name=exc.name
        ) from None
    resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sampling = engine_module.SamplingParams(
        max_tokens=steps + timed_steps + 8, temperature=0.0, ignore_eos=True
    )
    engine = engine_module.LLMEngine(
        engine_module.EngineConfig(
            model=model,
            device=resolved,
            max_num_seqs=max(batch, 1),
            compile_cpu_decode=compile_cpu_decode,
            cpu_format=cpu_format,
            lm_head_format=lm_head_format,
            enforce_eager=eager,
        )
    )
    waiting = {f"profile-{i}" for i in range(batch)}
    for request_id in sorted(waiting):
        engine.add_request(request_id, PROMPT, sampling)
    while waiting:  # prefill (several steps when the prompts exceed the token budget)
        waiting -= {out.request_id for out in engine.step()}
    engine.step()  # warm-up decode step
    _sync(resolved)
    engine.runner.synchronize_phases = True  # CUDA: "forward" is the GPU's time, not the launch's
    engine.step_times.reset()
    start = time.perf_counter()
    for _ in range(timed_steps):
        engine.step()
    _sync(resolved)
    step_s = (time.perf_counter() - start) / max(timed_steps, 1)
    phase_ms = engine.step_times.per_step_ms()
    compiled = engine.runner.compiled_decode

    def step():
        with profile_range("engine.step"):
            engine.step()

    report = profile_callable(
        step, resolved, steps=steps, warmup=0, trace=trace, ceilings=measure_ceilings(resolved)
    )
    kiln_share, op_share = kernel_shares(report, kiln_triton_kernel_names())
    return EngineStepProfile(
        report=report,
        batch=batch,
        decode_step_ms=step_s * 1e3,
        decode_tok_s=batch / step_s if timed_steps > 0 else 0.0,
        kiln_share=kiln_share,
        op_share=op_share,
        phase_ms=phase_ms,
        compiled_decode=compiled is not None and bool(compiled.compiled_sizes) and not compiled.failed,
    )


def format_phases(phase_ms: dict[str, float]) -> str:
    """The per-step phase table: milliseconds per phase, then the engine's own overhead (every phase
    but the forward) as one line."""
    lines = ["engine step phases (ms per step, unprofiled steps):"]
    lines += [f"  {phase:<12} {ms:8.3f}" for phase, ms in phase_ms.items()]
    overhead = sum(ms for phase, ms in phase_ms.items() if phase != "forward")
    lines.append(f"  {'overhead':<12} {overhead:8.3f}   (all but forward)")
    return "\n".join(lines)
