"""The tuner on planted ops: the fastest config is wrong and must lose, a crashing config is skipped,
and the winner round-trips through the tuning cache into the launcher."""

import json
import time

import pytest
import torch
import triton
import triton.language as tl

import kiln.ops.tuned_configs as tune_cache
import kiln.tune
from kiln.cli import main
from kiln.ops import registry
from kiln.ops.alloc import empty_like
from kiln.ops.registry import Implementation, OpSpec, triton_available
from kiln.ops.testing import randn
from kiln.tune.runner import tune_shape
from kiln.tune.search import candidates

CPU = torch.device("cpu")  # the planted Python ops; Triton ones run on the `device` fixture's device


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * 2.0 + 1.0, mask=mask)


SCALE_CONFIGS = [
    {"BLOCK": 64, "FLOOR_GRID": False},
    {"BLOCK": 256, "FLOOR_GRID": False},
    {"BLOCK": 512, "FLOOR_GRID": True},  # fewest programs, but the partial last block is never written
    {"BLOCK": 3, "FLOOR_GRID": False},  # not a power of two: tl.arange refuses to compile
]


def scale_triton(x, config=None):
    config = config or kiln.tune.lookup("planted_scale", x.dtype, {"n": x.numel()}) or SCALE_CONFIGS[0]
    y = empty_like(x)
    n, block = x.numel(), config["BLOCK"]
    grid = n // block if config["FLOOR_GRID"] else triton.cdiv(n, block)
    _scale_kernel[(max(grid, 1),)](x, y, n, BLOCK=block)
    return y


def make_spec(name, impl_name, fn, configs, is_available=registry.always_available):
    spec = OpSpec(
        name=name,
        reference=lambda x: x * 2 + 1,
        make_inputs=lambda shape, dtype, device, gen: {"x": randn((shape["n"],), dtype, device, gen)},
        fuzz_shapes=lambda rng: [{"n": 1000}],
        dtypes=(torch.float32,),
        tolerance={torch.float32: 1e-6},  # one fp32 multiply-add: exact up to rounding
        flops=lambda s, dtype: 2 * s["n"],
        bytes=lambda s, dtype: 8 * s["n"],
    )
    spec.register(Implementation(impl_name, fn, is_available, configs=lambda shape, dtype: list(configs)))
    return spec


def test_triton_tuner_rejects_the_fast_wrong_config_and_skips_the_crash(device):
    spec = make_spec("planted_scale", "triton", scale_triton, SCALE_CONFIGS, triton_available)
    shape = {"n": 1000}  # 1000 % 512 = 488 elements that the floor grid leaves unwritten
    result = tune_shape(spec, "triton", shape, torch.float32, device, timing_kwargs={"reps": 3})
    by_block = {t.config["BLOCK"]: t for t in result.trials}
    assert by_block[512].status == "wrong" and by_block[512].median_ms is None
    assert by_block[3].status == "crashed" and by_block[3].note
    assert by_block[64].status == by_block[256].status == "ok"
    assert result.best.config in SCALE_CONFIGS[:2]
    assert result.best.median_ms == min(by_block[64].median_ms, by_block[256].median_ms)
    # the launcher now finds the winner through the cache (same shape bucket: 1000 and 700 -> 1024)
    assert kiln.tune.lookup("planted_scale", torch.float32, {"n": 700}, device) == result.best.config
    stored = json.loads(tune_cache.user_cache_path().read_text())["entries"][result.cache_key]
    assert stored["config"] == result.best.config and stored["candidates"] == 4


def test_fastest_config_wins_only_among_correct_ones():
    def planted(x, config=None):
        if config.get("crash"):
            raise RuntimeError("out of shared memory")
        time.sleep(config["delay_ms"] / 1e3)
        return x * 2 + (1 if config["correct"] else 1.01)

    configs = [
        {"delay_ms": 0, "correct": False},
        {"delay_ms": 8, "correct": True},
        {"delay_ms": 40, "correct": True},
        {"crash": True},
    ]
    spec = make_spec("planted_sleepy", "python", planted, configs)
    result = tune_shape(spec, "python", {"n": 33}, torch.float32, CPU, save=False, timing_kwargs={"reps": 3})
    statuses = [t.status for t in result.trials]
    assert statuses == ["wrong", "ok", "ok", "crashed"]
    assert result.trials[0].error > 1e-3 and "out of shared memory" in result.trials[3].note
    assert result.best.config == {"delay_ms": 8, "correct": True}
    assert result.cache_key is None and not tune_cache.user_cache_path().exists()


def test_no_correct_config_stores_nothing():
    spec = make_spec("planted_wrong", "python", lambda x, config=None: x * 3, [{"a": 1}, {"a": 2}])
    result = tune_shape(spec, "python", {"n": 17}, torch.float32, CPU, timing_kwargs={"reps": 3})
    assert result.best is None and result.cache_key is None
    assert kiln.tune.lookup("planted_wrong", torch.float32, {"n": 17}) is None


def test_untunable_implementation_is_a_value_error():
    spec = make_spec("planted_scale", "triton", scale_triton, SCALE_CONFIGS, triton_available)
    with pytest.raises(ValueError, match="declares no configs"):
        tune_shape(spec, "reference", {"n": 8}, torch.float32, CPU)


def test_search_strategies():
    space = [{"b": i} for i in range(10)] + [{"b": 3}]
    assert candidates(space, "exhaustive") == [{"b": i} for i in range(10)]
    assert candidates(space, "exhaustive", budget=2) == [{"b": 0}, {"b": 1}]
    sample = candidates(space, "random", budget=4, seed=1)
    assert len(sample) == 4 and len({c["b"] for c in sample}) == 4
    assert sample == candidates(space, "random", budget=4, seed=1)
    with pytest.raises(ValueError, match="unknown strategy"):
        candidates(space, "genetic")


def test_tune_command_stores_and_exports_the_shipped_format(tmp_path, monkeypatch, capsys, device):
    spec = make_spec("planted_scale", "triton", scale_triton, SCALE_CONFIGS, triton_available)
    monkeypatch.setitem(registry._REGISTRY, "planted_scale", spec)
    monkeypatch.setattr(tune_cache, "SHIPPED_DIR", tmp_path / "configs")
    argv = ["tune", "planted_scale", "--shapes", '{"n": 777}', "--reps", "3", "--export"]
    rc = main([*argv, "--device", device.type])
    out = capsys.readouterr().out
    assert rc == 0 and "wrong" in out and "crashed" in out and "stored as" in out
    shipped = tune_cache.shipped_path(device)  # cpu.json here, e.g. nvidia-h100-80gb-hbm3.json on an H100
    assert shipped.parent == tmp_path / "configs"
    entries = json.loads(shipped.read_text())["entries"]
    exact, bucket = sorted(entries, key=lambda k: "from" in entries[k])  # the shape's, then its bucket's
    for key in entries:
        assert key.startswith(f"{tune_cache.device_name(device)}|triton-")
    assert exact.endswith("|planted_scale|float32=n=777") and bucket.endswith("|planted_scale|float32|n=1024")
    assert entries[bucket]["from"] == exact
    # with the user cache gone, the launcher falls back to the shipped file
    tune_cache.user_cache_path().unlink()
    monkeypatch.setattr(tune_cache, "_user_entries", None)
    assert kiln.tune.lookup("planted_scale", torch.float32, {"n": 777}, device) == entries[exact]["config"]
    x = torch.randn(777, device=device)
    torch.testing.assert_close(scale_triton(x), x * 2 + 1)


def test_two_tuned_shapes_in_one_bucket_keep_their_own_winners(tmp_path, monkeypatch):
    """n = 600 and n = 1000 share the bucket n = 1024: the later store replaced the earlier one's winner,
    so n = 600 ran n = 1000's config. Each now keeps its own; an untuned n = 800 gets the bucket's
    (the later)."""
    monkeypatch.setenv("KILN_TUNE_CACHE", str(tmp_path / "tune.json"))
    monkeypatch.setattr(tune_cache, "_user_entries", None)
    cpu = torch.device("cpu")
    tune_cache.store("op_x", torch.float32, {"n": 600}, {"BLOCK": 32}, device=cpu)
    tune_cache.store("op_x", torch.float32, {"n": 1000}, {"BLOCK": 128}, device=cpu)
    assert tune_cache.lookup("op_x", torch.float32, {"n": 600}, cpu) == {"BLOCK": 32}
    assert tune_cache.lookup("op_x", torch.float32, {"n": 1000}, cpu) == {"BLOCK": 128}
    assert tune_cache.lookup("op_x", torch.float32, {"n": 800}, cpu) == {"BLOCK": 128}
    assert tune_cache.lookup("op_x", torch.float32, {"n": 2000}, cpu) is None
