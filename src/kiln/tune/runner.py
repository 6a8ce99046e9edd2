"""`kiln tune`'s engine: for one op, dtype and shape, find the fastest config that is also correct.

Every candidate is first run like `kiln verify` does (fresh random inputs, float64 reference,
poisoned outputs) and only a candidate within the op's tolerance is timed, so a fast wrong config can
never win; a candidate that crashes (compile error, out of resources, ...) is skipped with its message.
The winner goes to the user's tuning cache through `kiln.tune.store`, where the launchers'
`kiln.tune.lookup` finds it at run time. The key it is stored under is the one the launcher itself
asks for on these inputs (`cache_request`), never rebuilt from the OpSpec's shape dict: the two
differed for most tunable ops on some of their shapes (flags a launcher adds or drops, per-sequence
length lists that it reduces to a batch and a maximum), and `kiln tune` stored configs nothing read.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch

from kiln.bench.runner import make_input_sets
from kiln.bench.timing import time_fn
from kiln.ops.registry import Implementation, OpSpec
from kiln.ops.tuned_configs import LookupRequest, launcher_request, store
from kiln.tune.search import candidates as choose_candidates
from kiln.verify.runner import dtype_name, run_case


@dataclass
class Trial:
    """One candidate config: status is "ok" (timed), "wrong" (failed the check) or "crashed"."""

    config: dict
    status: str
    error: float | None = None
    median_ms: float | None = None
    note: str = ""


@dataclass
class TuneResult:
    op: str
    backend: str
    dtype: str
    shape: dict
    trials: list[Trial] = field(default_factory=list)
    best: Trial | None = None
    cache_key: str | None = None


def with_config(spec: OpSpec, impl: Implementation, config: dict) -> OpSpec:
    """A copy of `spec` whose only implementation, "candidate", is `impl` pinned to `config`."""
    pinned = Implementation("candidate", functools.partial(impl.fn, config=config), impl.is_available)
    return dataclasses.replace(spec, implementations={"candidate": pinned})


def cache_request(spec: OpSpec, backend: str, inputs: dict) -> LookupRequest:
    """The cache entry `spec`'s `backend` launcher reads for `inputs` (op, dtype, shape dict, device),
    taken from the launcher itself: it runs up to its `lookup` of `spec.name` and stops there, before
    any kernel. ValueError when it never looks the op up for these inputs (nothing stored could be
    found)."""
    request = launcher_request(spec.implementation(backend).fn, inputs, spec.name)
    if request is None:
        raise ValueError(
            f"kiln tune: {spec.name}/{backend} does not read the tuning cache for these inputs "
            f"(no lookup of {spec.name!r}), so a tuned config could never be used"
        )
    return request


def tune_shape(
    spec: OpSpec,
    backend: str,
    shape: dict,
    dtype: torch.dtype,
    device: torch.device,
    *,
    strategy: str = "exhaustive",
    budget: int | None = None,
    seed: int = 0,
    save: bool = True,
    timing_kwargs: dict | None = None,
    progress=None,
) -> TuneResult:
    """Try the candidates for one shape; store the winner when `save` (and there is one).

    progress: optional tqdm-like object; `update(1)` is called after each candidate."""
    impl = spec.implementation(backend)
    if impl.configs is None:
        raise ValueError(f"kiln tune: {spec.name}/{backend} declares no configs, nothing to tune")
    if not impl.is_available(device):
        raise ValueError(
            f"kiln tune: {spec.name}/{backend} cannot run on {device}"
            + (" (set TRITON_INTERPRET=1)" if backend == "triton" else "")
        )
    result = TuneResult(spec.name, backend, dtype_name(dtype), dict(shape))
    configs = choose_candidates(impl.configs(shape, dtype), strategy, budget, seed)
    input_sets, request = None, None
    for i, config in enumerate(configs):
        trial = _try(spec, impl, config, shape, dtype, device, seed + i)
        if trial.status == "ok":
            if input_sets is None:
                # one copy off the GPU: the interpreter's launches are slow and CPU caches are not the point
                copies = None if device.type == "cuda" else 1
                input_sets = make_input_sets(
                    spec, shape, dtype, device, seed=seed + 10_000, max_copies=copies
                )
                if save:  # the key, from the launcher itself; now, not after every candidate has run
                    request = cache_request(spec, backend, input_sets[0])
            try:
                fn = functools.partial(impl.fn, config=config)
                timing = time_fn(
                    lambda inputs, fn=fn: fn(**inputs), input_sets, device, **(timing_kwargs or {})
                )
                trial.median_ms = timing.median_ms
            except Exception as exc:  # failed only under timing (e.g. graph capture of a broken config)
                trial.status, trial.note = "crashed", f"while timing: {type(exc).__name__}: {exc}"
        result.trials.append(trial)
        if progress is not None:
            progress.update(1)
    timed = [t for t in result.trials if t.status == "ok"]
    if timed:
        result.best = min(timed, key=lambda t: t.median_ms)
        if save:
            meta = {
                "median_ms": result.best.median_ms,
                "rel_error": result.best.error,
                "backend": backend,
                "candidates": len(configs),
                "strategy": strategy,
                "shape": dict(shape),
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            result.cache_key = store(
                request.op, request.dtype, request.shape, result.best.config, meta=meta, device=request.device
            )
    return result


def _try(spec, impl, config, shape, dtype, device, seed) -> Trial:
    case = run_case(with_config(spec, impl, config), "candidate", shape, dtype, device, seed)
    if case.crashed:
        return Trial(config, "crashed", None, note=case.failure)
    if not case.passed:
        why = case.failure or f"relative error {case.error:.2e} > tolerance {case.tolerance:.1e}"
        return Trial(config, "wrong", case.error, note=why)
    return Trial(config, "ok", case.error)
