"""`kiln tune` stores each winner under the key its launcher looks up, for every tunable op and backend,
and concurrent writers of the tuning cache keep each other's entries.

The tuner used to store under the OpSpec's shape dict while the launchers built their own: fused_moe
added `fp8` and dropped `skew`, flash_attention_backward added `causal`, sparse24_linear dropped
`bias`, and on fuzz shapes (per-sequence length lists, flags) most other ops differed too, so the
tuned configs were never read. Now the tuner takes the key from the launcher itself."""

import json
import os
import random
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

import kiln.ops.tuned_configs as tune_cache
import kiln.tune.runner as runner
from kiln.ops import all_ops
from kiln.ops.moe.fused_moe.spec import FUSED_MOE
from kiln.ops.registry import Implementation, OpSpec
from kiln.ops.testing import randn
from kiln.tune.runner import Trial, tune_shape
from kiln.verify.runner import run_case

# make_inputs draws on the CPU: bench shapes above this are LLM-sized (gigabytes of MoE weights), and
# their keys are built by the same launcher code as the small ones'. At most BENCH_SHAPES of them
# per op (gguf_linear has 40 small ones, one per quant type and size: 10 s of quantizing weights).
INPUT_BYTES_LIMIT = 16e6
BENCH_SHAPES = 8


def _tunable():
    for name, spec in sorted(all_ops().items()):
        for backend, impl in spec.implementations.items():
            if impl.configs is not None:
                yield pytest.param(name, backend, id=f"{name}-{backend}")


def _shapes(spec, dtype):
    """The op's fuzz shapes, then its bench shapes small enough to make on the CPU, without repeats."""
    bench = [
        shape
        for suite in spec.bench_shapes.values()
        for shape in suite
        if spec.bytes(shape, dtype) <= INPUT_BYTES_LIMIT
    ]
    shapes = spec.fuzz_shapes(random.Random(0)) + bench[:BENCH_SHAPES]
    unique = []
    for shape in shapes:
        if shape not in unique:
            unique.append(shape)
    return unique


class _Looked(BaseException):
    """Stops a launcher at its first cache lookup of the op, after the lookup found (or not) its entry."""


def _launcher_lookup(monkeypatch, spec, backend, inputs):
    """(key, config) of the launcher's lookup of `spec.name` in a plain call, not the tuner's probe:
    the user cache is read as always, and the call stops right after (no kernel runs)."""
    found = []
    read_user = tune_cache._user

    class Spy(dict):
        def get(self, key, default=None):
            entry = read_user().get(key, default)
            if f"|{spec.name}|" in key:
                found.append((key, entry))
                raise _Looked
            return entry

    monkeypatch.setattr(tune_cache, "_user", Spy)
    try:
        spec.implementation(backend).fn(**inputs)
    except _Looked:
        pass
    finally:
        monkeypatch.setattr(tune_cache, "_user", read_user)
    assert found, f"{spec.name}/{backend} returned without looking up its tuned config"
    key, entry = found[0]
    return key, entry["config"] if entry else None


@pytest.mark.parametrize(("name", "backend"), _tunable())
def test_tuner_stores_where_the_launcher_looks(name, backend, monkeypatch, device):
    """`tune_shape` end to end (candidates, input sets, the key, the store), with every candidate
    passing and timed at 1 ms instead of run, then a plain call of the launcher on fresh inputs of the
    same shape: its lookup finds the stored config, on every fuzz shape and small bench shape."""
    spec = all_ops()[name]
    impl = spec.implementation(backend)
    if not impl.is_available(device):
        pytest.skip(f"{name}/{backend} does not run on {device}")
    dtype = torch.float32 if torch.float32 in spec.dtypes else spec.dtypes[0]
    monkeypatch.setattr(runner, "_try", lambda spec, impl, config, *args: Trial(config, "ok", 0.0))
    monkeypatch.setattr(runner, "time_fn", lambda *args, **kwargs: types.SimpleNamespace(median_ms=1.0))
    shapes = [shape for shape in _shapes(spec, dtype) if impl.configs(shape, dtype)]  # else nothing to tune
    assert shapes
    for i, shape in enumerate(shapes):
        result = tune_shape(spec, backend, shape, dtype, device, budget=1, seed=i)
        assert result.cache_key is not None, shape
        inputs = spec.make_inputs(shape, dtype, device, torch.Generator().manual_seed(1000 + i))
        key, config = _launcher_lookup(monkeypatch, spec, backend, inputs)
        assert key == result.cache_key, f"{name}/{backend} {shape}"
        assert config == result.best.config, f"{name}/{backend} {shape}"


def test_kiln_tune_fused_moe_config_is_used_by_its_launcher(monkeypatch, device):
    """The reviewer's case, tuned for real: a non-fp8 fused_moe shape (the launcher adds fp8=False to
    its key, the spec shape has no fp8). The launcher then runs the tuned config, correctly."""
    shape = {"tokens": 5, "hidden": 64, "intermediate": 48, "experts": 8, "top_k": 2, "skew": 0.5}
    dtype = torch.float32
    result = tune_shape(FUSED_MOE, "triton", shape, dtype, device, budget=2, timing_kwargs={"reps": 3})
    assert result.best is not None and "fp8=False" in result.cache_key and "skew" not in result.cache_key
    stored = json.loads(tune_cache.user_cache_path().read_text())["entries"]
    # the shape's own entry and its bucket's, which names it
    (bucket,) = (key for key in stored if key != result.cache_key)
    assert stored[bucket]["from"] == result.cache_key and stored[result.cache_key]["shape"] == shape

    inputs = FUSED_MOE.make_inputs(shape, dtype, device, torch.Generator().manual_seed(7))
    key, config = _launcher_lookup(monkeypatch, FUSED_MOE, "triton", inputs)
    assert key == result.cache_key and config == result.best.config
    # and a whole launch with that config (it goes through the cache) passes the verifier's check
    case = run_case(FUSED_MOE, "triton", shape, dtype, device, seed=3)
    assert case.passed, case.failure


def test_tuner_refuses_a_launcher_that_never_reads_the_cache():
    """Storing a config nothing reads was the silent failure: now it is an error, before timing."""
    spec = OpSpec(
        name="planted_unread",
        reference=lambda x: x * 2 + 1,
        make_inputs=lambda shape, dtype, device, gen: {"x": randn((shape["n"],), dtype, device, gen)},
        fuzz_shapes=lambda rng: [{"n": 16}],
        dtypes=(torch.float32,),
        tolerance={torch.float32: 1e-6},
        flops=lambda s, dtype: 2 * s["n"],
        bytes=lambda s, dtype: 8 * s["n"],
    )
    configs = [{"a": 1}]
    spec.register(Implementation("python", lambda x, config=None: x * 2 + 1, configs=lambda s, d: configs))
    with pytest.raises(ValueError, match="does not read the tuning cache"):
        tune_shape(spec, "python", {"n": 16}, torch.float32, torch.device("cpu"), timing_kwargs={"reps": 3})
    assert not tune_cache.user_cache_path().exists()


# The worker loads kiln/ops/tuned_configs.py by its path: it needs torch only, and importing all of
# kiln.ops in two processes on a shared CI machine would take most of the test's time.
RACE_WORKER = textwrap.dedent(
    """
    import importlib.util, sys, time
    from pathlib import Path
    import torch
    module_path, tag, n, start = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    spec = importlib.util.spec_from_file_location("tuned_configs_under_test", module_path)
    cache = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache)
    cache.triton_version()  # imports triton (part of every key) before the start
    (start.parent / f"ready-{tag}").touch()
    while not start.exists():  # both processes start writing at the same moment
        time.sleep(0.001)
    for i in range(n):
        cache.store(f"op_{tag}", torch.float32, {"rows": 2**i}, {"BLOCK": 64}, device=torch.device("cpu"))
    """
)


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Two processes store 40 distinct shapes each into one cache at the same time: all 80 are kept,
    each under two keys (without the lock, 40-63 of 80 were, the last writer dropping what the other
    wrote meanwhile)."""
    cache, start, n = tmp_path / "tune.json", tmp_path / "start", 40
    env = {**os.environ, "KILN_TUNE_CACHE": str(cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_WORKER, tune_cache.__file__, tag, str(n), str(start)], env=env
        )
        for tag in ("a", "b")
    ]
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{tag}").exists() for tag in ("a", "b")):
            assert all(p.poll() is None for p in procs), "a writer died before writing"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start.touch()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 2 * 2 * n  # each store: the shape's exact key and its bucket's
    assert {key.split("|")[2] for key in entries} == {"op_a", "op_b"}
