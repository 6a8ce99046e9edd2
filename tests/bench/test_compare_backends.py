"""`kiln bench --compare-backends` and flash_attention's `jax_dot_product_attention` baseline: other
Kiln implementations and XLA's attention timed on the same inputs in one run (issue #23's Pallas-GPU
vs XLA vs Triton comparison, which runs for real on a GPU), checked on CPU for what they compute and
record."""

import pytest
import torch

pytest.importorskip("jax")

from kiln.bench.ceilings import measure_ceilings  # noqa: E402
from kiln.bench.runner import bench_case  # noqa: E402
from kiln.bench.suites import Case  # noqa: E402
from kiln.ops import get_op  # noqa: E402
from kiln.ops.attention.flash_attention.jax_baseline import jax_dot_product_attention  # noqa: E402
from kiln.verify import relative_error  # noqa: E402

CPU = torch.device("cpu")
UNIFORM = {"batch": 2, "seqlen_q": 13, "seqlen_k": 13, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16}


@pytest.mark.parametrize("window", [None, 5])
def test_jax_dot_product_attention_baseline_matches_the_float64_reference(window):
    spec = get_op("flash_attention")
    shape = dict(UNIFORM, sliding_window=window)
    inputs = spec.make_inputs(shape, torch.float32, CPU, torch.Generator().manual_seed(3))
    expected = spec.reference(**{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                                 for k, v in inputs.items()})  # fmt: skip
    got = jax_dot_product_attention(**inputs)
    assert got.shape == expected.shape and not got.isnan().any()
    assert relative_error(got, expected) < 1e-5


def test_jax_dot_product_attention_baseline_names_what_it_cannot_run():
    spec = get_op("flash_attention")
    ragged = {"seqlens_q": [5, 3], "seqlens_k": [5, 3], "num_heads": 2, "num_kv_heads": 2, "head_dim": 16}
    inputs = spec.make_inputs(ragged, torch.float32, CPU, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="uniform batches"):
        jax_dot_product_attention(**inputs)
    capped = dict(UNIFORM, softcap=5.0)
    inputs = spec.make_inputs(capped, torch.float32, CPU, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="softcap"):
        jax_dot_product_attention(**inputs)


def test_compare_backends_times_other_implementations_on_the_same_inputs():
    case = Case(get_op("flash_attention"), UNIFORM, torch.float32)
    record = bench_case(
        case, CPU, measure_ceilings(CPU), backend="xla", timing_kwargs={"reps": 2},
        compare_backends=("xla", "cpu", "no_such_backend"),
    )  # fmt: skip
    assert record["error"] is None and record["backend"] == "xla"
    baselines = record["baselines"]
    assert "kiln_xla" not in baselines  # the timed backend itself is not compared with itself
    for name in ("kiln_cpu", "torch_sdpa", "jax_dot_product_attention"):
        assert baselines[name]["median_ms"] > 0 and baselines[name]["speedup"] > 0, name
    assert "error" in baselines["kiln_no_such_backend"]
