"""kiln.ops.float64_rounding against numpy's float16 and ml_dtypes' bfloat16 casts (each rounds a
float64 once), on values a hair either side of a 16-bit midpoint, where a cast through float32 rounds
twice and half of them land one ulp off."""

import random

import numpy as np
import pytest
import torch

from kiln.ops.float64_rounding import round_from_float64


def _near_midpoints(mantissa_bits: int, exponents: int, count: int, rng: random.Random) -> torch.Tensor:
    values = []
    for _ in range(count):
        m, e = rng.randint(0, 2**mantissa_bits - 1), rng.randint(-exponents, exponents)
        midpoint = (1 + (2 * m + 1) / 2 ** (mantissa_bits + 1)) * 2.0**e
        hair = rng.choice([-1, 1]) * 2.0 ** -rng.randint(26, 50)  # below float32's resolution from 2^-25
        values.append(rng.choice([-1, 1]) * midpoint * (1 + hair))
    values += [rng.gauss(0, 1) * 10.0 ** rng.randint(-6, 4) for _ in range(count)]
    values += [0.0, -0.0, float("inf"), float("-inf"), 1e300, -1e-300]
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rounds_once_as_numpy_and_ml_dtypes_do(dtype):
    if dtype == torch.bfloat16:
        reference_dtype = pytest.importorskip("ml_dtypes").bfloat16
        x = _near_midpoints(7, 100, 5000, random.Random(0))
    else:
        reference_dtype = np.float16
        x = _near_midpoints(10, 14, 5000, random.Random(1))
    with np.errstate(over="ignore"):
        want = torch.from_numpy(x.numpy().astype(reference_dtype).astype(np.float64))
    got = round_from_float64(x, dtype)
    assert got.dtype == dtype
    assert torch.equal(got.double(), want)
    nan = round_from_float64(torch.tensor([float("nan")], dtype=torch.float64), dtype)
    assert nan.isnan().all()


def test_a_value_just_below_a_bfloat16_midpoint_rounds_down():
    # bfloat16 neighbours 0.2373046875 and 0.23828125 (2^-9 apart), midpoint 0.23779296875; this value
    # is 1e-9 below it, and a cast through float32 lands on the midpoint, then ties to even (up)
    x = torch.tensor([0.23779296776924158, -0.23779296776924158], dtype=torch.float64)
    assert round_from_float64(x, torch.bfloat16).tolist() == [0.2373046875, -0.2373046875]


def test_float32_is_a_plain_cast_and_other_inputs_are_refused():
    x = torch.randn(7, dtype=torch.float64)
    assert torch.equal(round_from_float64(x, torch.float32), x.float())
    with pytest.raises(ValueError, match="must be float64"):
        round_from_float64(x.float(), torch.bfloat16)
