import time

import pytest
import torch

from kiln.bench.timing import copies_to_flush, quantile, summarize, time_fn


def test_quantiles_interpolate_linearly():
    samples = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert quantile(samples, 0.5) == 3.0
    assert quantile(samples, 0.2) == pytest.approx(1.8)
    assert quantile(samples, 0.8) == pytest.approx(4.2)
    t = summarize(samples, copies=2, method="cpu-wallclock")
    assert (t.median_ms, t.reps, t.copies) == (3.0, 5, 2)
    assert t.rel_spread == pytest.approx((4.2 - 1.8) / 3.0)


def test_input_copies_exceed_twice_the_cache_within_the_memory_budget():
    device = torch.device("cpu")
    one_mib = 2**20
    assert copies_to_flush(one_mib, device, max_copies=1000, memory_budget=2**40) == 64  # 2 x 32 MiB / 1 MiB
    assert copies_to_flush(one_mib, device, max_copies=8, memory_budget=2**40) == 8
    assert copies_to_flush(one_mib, device, max_copies=1000, memory_budget=3 * one_mib) == 3
    assert copies_to_flush(2**30, device, max_copies=64, memory_budget=2**40) == 1


def test_cpu_timing_measures_the_callable_and_rotates_inputs():
    seen = []

    def sleepy(inputs):
        seen.append(inputs["i"])
        time.sleep(0.004)

    t = time_fn(sleepy, [{"i": 0}, {"i": 1}], torch.device("cpu"), warmup=1, reps=3)
    assert t.method == "cpu-wallclock" and t.reps == 3 and t.copies == 2
    assert 3.9 <= t.median_ms < 40.0  # one call sleeps 4 ms; generous upper bound for a shared CPU
    assert t.p20_ms <= t.median_ms <= t.p80_ms
    assert seen == [0, 1] * 4  # warm-up pass + 3 timed passes, each over both copies
