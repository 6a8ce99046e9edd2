"""OpSpec.call_case: the case (shape, dtype) a call's own arguments make, which `kiln profile` puts on
the roofline for the calls it observes (the engine's). For every fuzz case of an op that has one, the
case read back from the inputs `make_inputs` built for it has the same FLOPs, bytes and matmul dtype."""

import random

import pytest
import torch

from kiln.ops import all_ops

# Ops whose calls do not tell their case yet (their kernels still map to them in a profile, without a
# roofline fraction). Listed so that a new op decides.
WITHOUT_CALL_CASE: set[str] = set()


def _ops_with_call_case():
    return sorted(name for name, spec in all_ops().items() if spec.call_case is not None)


def test_every_op_has_a_call_case_or_is_listed_without_one():
    missing = {name for name, spec in all_ops().items() if spec.call_case is None}
    assert missing == WITHOUT_CALL_CASE


@pytest.mark.parametrize("name", _ops_with_call_case())
def test_call_case_of_fuzz_inputs_has_the_cases_flops_and_bytes(name):
    spec = all_ops()[name]
    rng = random.Random(1234)
    checked = 0
    for i, shape in enumerate(spec.fuzz_shapes(rng)):
        dtype = spec.dtypes[i % len(spec.dtypes)]
        try:
            inputs = spec.make_inputs(shape, dtype, torch.device("cpu"), torch.Generator().manual_seed(i))
        except (ValueError, RuntimeError, NotImplementedError) as exc:  # a case this CPU cannot build
            if "cannot" not in str(exc) and "not supported" not in str(exc):
                raise
            continue
        bound = spec.bind((), inputs)
        case = spec.call_case(*bound)
        assert case is not None, (shape, dtype)
        got_shape, got_dtype = case
        for what in ("flops", "bytes"):
            want = getattr(spec, what)(shape, dtype)
            got = getattr(spec, what)(got_shape, got_dtype)
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9), (what, shape, dtype, got_shape, got_dtype)
        assert spec.peak_dtype(got_shape, got_dtype) == spec.peak_dtype(shape, dtype), (shape, dtype)
        checked += 1
    assert checked >= 3
