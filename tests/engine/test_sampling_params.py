"""SamplingParams refuses a wrong type or range with a ValueError naming the field, at construction:
never a TypeError from a comparison, nor a crash later in the engine step of the whole batch."""

import numpy as np
import pytest

from kiln.engine import LLM
from kiln.engine.sampling_params import SamplingParams

from .toy_model import toy_loaded


@pytest.mark.parametrize(
    "field, value",
    [
        ("stop_token_ids", 5),
        ("stop_token_ids", "5"),
        ("stop_token_ids", [5, "6"]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [-1]),
        ("temperature", None),
        ("temperature", "0.5"),
        ("temperature", True),
        ("temperature", float("inf")),
        ("top_p", None),
        ("top_p", "0.9"),
        ("top_p", float("nan")),
        ("min_p", "0.1"),
        ("min_p", None),
        ("top_k", 2.0),
        ("max_tokens", None),
        ("stop", 5),
        ("stop", ["ok", 3]),
        ("ignore_eos", "no"),
    ],
)
def test_a_wrong_type_or_range_is_a_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams: {field}="):
        SamplingParams(**{field: value})


def test_accepted_spellings_are_normalized():
    params = SamplingParams(stop_token_ids=(4, 5), stop=("x", "y"), temperature=np.float32(0.5), top_p=1)
    assert params.stop_token_ids == [4, 5] and params.stop == ["x", "y"]
    assert SamplingParams(stop="z").stop == ["z"]


def test_an_integer_stop_token_ids_no_longer_reaches_the_scheduler():
    """stop_token_ids=5 was accepted, then `token in 5` raised a TypeError in Scheduler.postprocess,
    failing every request of the step."""
    llm = LLM(loaded=toy_loaded(), num_kv_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["abc"], SamplingParams(max_tokens=4, stop_token_ids=5))
    out = llm.generate(["abc"], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[5]))
    assert len(out[0].token_ids) >= 1
